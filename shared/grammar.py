"""Structured outputs' grammars: what a request's spec is, and compiling it with a well-kept library.

A `GrammarSpec` is what travels with a request (its kind and text, in a bounded area of the slot record:
blink.shared.slot_table); the ingress compiles it once to refuse what cannot be served (a 400, never a 500), the
engine compiles it again to mask its rows (blink.engine.core.grammar). Both go through `GrammarCompiler`: a cache keyed
by the spec, compiles on worker threads (xgrammar releases the GIL) under a time limit, one compile per spec however
many ask. `Backend` is where a library plugs in; `XGrammar` is the one used (what vLLM and SGLang default to).
xgrammar imports torch and transformers, so it is imported on first use, never by this module.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, StrictBool, model_validator
from pydantic import Field as PydanticField

COMPILE_TIMEOUT_S = 10.0  # a compile past this is refused (xgrammar can take unbounded time on nested schemas)
CACHED_GRAMMARS = 256  # specs whose compiled grammar (or error) each side keeps
# JSON Schema keywords xgrammar accepts but does not enforce: refused, so an answer never breaks its schema quietly.
UNENFORCED_KEYWORDS = frozenset({"not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies"})
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})  # keys there are names
_VALUES = frozenset({"enum", "const", "default", "examples", "description", "title"})  # data, not schemas


class GrammarKind(IntEnum):
    """A record's grammar_kind: what its grammar text is."""

    NONE = 0
    JSON_SCHEMA = 1  # a JSON schema (json_object is {"type": "object"})
    REGEX = 2
    EBNF = 3  # xgrammar's EBNF (GBNF); vLLM's `grammar` and `choice` (as alternatives of literals)


class GrammarError(ValueError):
    """A spec that cannot be served: invalid, unsupported, too large, or too slow to compile. Its message is the
    client's."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    text: str

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        """vLLM's `choice`: exactly one of the strings (as vLLM's xgrammar backend writes it, an EBNF of literals)."""
        if not options:
            raise GrammarError("choice needs at least one option")
        return cls(GrammarKind.EBNF, "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        """A schema given as a dict or as its JSON text; checked for keywords xgrammar would not enforce."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema must be an object")
        try:
            where = _unenforced(schema, "#")
            text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        except RecursionError:
            raise GrammarError("the JSON schema is nested too deeply") from None
        if where is not None:
            raise GrammarError(f"the JSON schema keyword at {where[:200]} is not supported for structured outputs")
        return cls(GrammarKind.JSON_SCHEMA, text)


def _unenforced(schema: Any, path: str) -> str | None:
    """Where the first keyword of UNENFORCED_KEYWORDS is in `schema`, or None."""
    if isinstance(schema, list):
        return next((w for i, item in enumerate(schema) if (w := _unenforced(item, f"{path}/{i}")) is not None), None)
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in UNENFORCED_KEYWORDS:
            return f"{path}/{key}"
        if key in _VALUES:
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            found = next((w for name, sub in value.items() if (w := _unenforced(sub, f"{path}/{key}/{name}"))), None)
        else:
            found = _unenforced(value, f"{path}/{key}")
        if found is not None:
            return found
    return None


class Backend(Protocol):
    """A grammar library: compiles a spec for one vocabulary, and makes a matcher of what it compiled."""

    def compile(self, spec: GrammarSpec) -> Any: ...

    def matcher(self, compiled: Any) -> Any: ...


class XGrammar:
    """xgrammar over a `tokenizers` tokenizer (blink.shared.tokenizer.Tokenizer's `raw`), for a model of
    `vocab_size` logits (the tokenizer's vocabulary padded, maybe) that stops on `stop_ids`. JSON schemas compile with
    any whitespace between items, at most `max_whitespace` in a row (a model that drifts into blank space still
    closes its object)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], max_whitespace: int = 4):
        if not stop_ids:  # a complete grammar allows only the end token: without one, no answer could end
            raise GrammarError("this model has no end-of-sequence token, so a structured output could never end")
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr, self.max_whitespace = xgr, max_whitespace
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                  vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # our cache: GrammarCompiler

    def compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        try:
            if spec.kind == GrammarKind.JSON_SCHEMA:
                return c.compile_json_schema(spec.text, any_whitespace=True, max_whitespace_cnt=self.max_whitespace)
            if spec.kind == GrammarKind.REGEX:
                return c.compile_regex(spec.text)
            if spec.kind == GrammarKind.EBNF:
                return c.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:  # the library's words: why the spec is invalid
            raise GrammarError(f"invalid {_WORDS[spec.kind]}: {_first_line(e)}") from None
        raise GrammarError(f"unknown grammar kind {int(spec.kind)}")

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)


_WORDS = {GrammarKind.JSON_SCHEMA: "JSON schema", GrammarKind.REGEX: "regex", GrammarKind.EBNF: "grammar"}


def _first_line(e: BaseException) -> str:
    """xgrammar's message without its source location ("[time] file.cc:line: ")."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text.split(": ", 1)[1][:300] if text.startswith("[") and ": " in text else text[:300]


class GrammarCompiler:
    """A backend's compiles, cached by spec (the error too: a bad spec is refused again without recompiling), on
    `threads` worker threads, each awaited at most `timeout_s`. A compile that runs out of time goes on in its thread
    and lands in the cache; the caller is refused meanwhile."""

    def __init__(self, backend: Backend, timeout_s: float = COMPILE_TIMEOUT_S, threads: int = 2,
                 cached: int = CACHED_GRAMMARS):
        self.backend, self.timeout_s, self.cached = backend, timeout_s, cached
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # cold compiles started (the cache's misses)

    def submit(self, spec: GrammarSpec) -> Future:
        """The spec's compile: the cached one, or one started now."""
        with self._lock:
            future = self._futures.get(spec)
            if future is None:
                future = self._futures[spec] = self._pool.submit(self.backend.compile, spec)
                self.compiles += 1
                while len(self._futures) > self.cached:
                    self._futures.popitem(last=False)
            else:
                self._futures.move_to_end(spec)
            return future

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> Any:
        """The compiled grammar; GrammarError when the spec is invalid or its compile outlasts the time limit."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self.submit(spec).result(limit)
        except FutureTimeout:
            raise GrammarError(f"the {_WORDS.get(spec.kind, 'grammar')} did not compile within {limit:g} s; "
                               "simplify it (fewer nested or optional parts)") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): exactly one of a JSON schema, a regex, a list of
    choices, an EBNF grammar, or any JSON object. The OpenAI bodies and the offline API's SamplingParams take it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_: dict | str | None = PydanticField(None, alias="json", description="a JSON schema (an object, or its text)")
    regex: str | None = None
    choice: list[str] | None = PydanticField(None, min_length=1)
    grammar: str | None = PydanticField(None, description="an EBNF (GBNF) grammar whose start rule is root")
    json_object: StrictBool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar, json_object")
        return self

    def spec(self) -> GrammarSpec:
        """The grammar it asks for; GrammarError when it cannot be one."""
        if self.json_ is not None:
            return GrammarSpec.json_schema(self.json_)
        if self.regex is not None:
            return GrammarSpec(GrammarKind.REGEX, self.regex)
        if self.choice is not None:
            return GrammarSpec.choice(self.choice)
        if self.grammar is not None:
            return GrammarSpec(GrammarKind.EBNF, self.grammar)
        return GrammarSpec.json_schema(ANY_OBJECT)


ANY_OBJECT = {"type": "object"}  # json_object, as vLLM compiles it


def check_combination(ignore_eos: bool, min_tokens: int) -> None:
    """A GrammarError for what a grammar cannot be served with: a complete grammar allows only the end-of-sequence
    token, which ignore_eos would sample past and min_tokens would hold back."""
    if ignore_eos:
        raise GrammarError("ignore_eos cannot be combined with structured outputs: a complete answer ends there")
    if min_tokens:
        raise GrammarError("min_tokens cannot be combined with structured outputs: the grammar decides the length")
