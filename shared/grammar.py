"""Structured outputs' grammars: what a request's spec is, and compiling it with a well-kept library.

A `GrammarSpec` is what travels with a request (its kind and text, in a bounded area of the slot record:
blink.shared.slot_table); the ingress compiles it once to refuse what cannot be served (a 400, never a 500), the
engine compiles it again to mask its rows (blink.engine.core.grammar). Both go through `GrammarCompiler`: a cache keyed
by the spec, compiles on worker threads (the libraries release the GIL) under a time limit, one compile per spec
however many ask. `Backend` is where a library plugs in (blink.shared.grammar_backends: llguidance by default, or
xgrammar), imported on first use, never by this module.
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

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictBool, model_validator
from pydantic import Field as PydanticField

COMPILE_TIMEOUT_S = 10.0  # a compile past this is refused (xgrammar can take unbounded time on nested schemas)
CACHED_GRAMMARS = 256  # specs whose compiled grammar (or error) each side keeps
# JSON Schema keywords xgrammar accepts but does not enforce (llguidance refuses them): refused whatever the backend,
# so an answer never breaks its schema quietly and both backends refuse alike.
UNENFORCED_KEYWORDS = frozenset({"not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies"})
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})  # keys there are names
VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples", "description", "title"})  # data, not schemas


class GrammarKind(IntEnum):
    """A record's grammar_kind: what its grammar text is."""

    NONE = 0
    JSON_SCHEMA = 1  # a JSON schema (json_object is {"type": "object"})
    REGEX = 2
    EBNF = 3  # vLLM's `grammar`: GBNF (either backend) or Lark (guidance); `choice` as GBNF alternatives of literals


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
        """A schema given as a dict or as its JSON text; checked for keywords a backend would not enforce."""
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
        if key in VALUE_KEYWORDS:
            continue
        if key in NAMED_SCHEMAS and isinstance(value, dict):
            found = next((w for name, sub in value.items() if (w := _unenforced(sub, f"{path}/{key}/{name}"))), None)
        else:
            found = _unenforced(value, f"{path}/{key}")
        if found is not None:
            return found
    return None


class Backend(Protocol):
    """A grammar library (blink.shared.grammar_backends): compiles a spec for one vocabulary (GrammarError when it
    cannot), makes a matcher of what it compiled, fills a matcher's next-token bitmask into a row of an int32
    [rows, ceil(V / 32)] array (bit b of word w: token 32 * w + b allowed), and moves a matcher on by a token."""

    name: str

    def compile(self, spec: GrammarSpec) -> Any: ...

    def matcher(self, compiled: Any) -> Any: ...

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None: ...

    def accept(self, matcher: Any, token: int) -> bool: ...


KIND_WORDS = {GrammarKind.JSON_SCHEMA: "JSON schema", GrammarKind.REGEX: "regex", GrammarKind.EBNF: "grammar"}


class GrammarCompiler:
    """A backend's compiles, cached by spec (the error too: a bad spec is refused again without recompiling), on
    `threads` worker threads, each awaited at most `timeout_s`. A compile that runs out of time goes on in its thread
    and lands in the cache; the caller is refused meanwhile. The cache keeps the `cached` specs used last, beside those
    submitted pinned, which it never evicts."""

    def __init__(self, backend: Backend, timeout_s: float = COMPILE_TIMEOUT_S, threads: int = 2,
                 cached: int = CACHED_GRAMMARS):
        self.backend, self.timeout_s, self.cached = backend, timeout_s, cached
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[GrammarSpec, Future] = OrderedDict()  # least recently used first
        # Outside `cached`: a compile that outlasts the time limit (json_object's lowering) would be refused once
        # evicted, so the one made at start-up stays.
        self._pinned: dict[GrammarSpec, Future] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # cold compiles started (the cache's misses)

    def submit(self, spec: GrammarSpec, pin: bool = False) -> Future:
        """The spec's compile: the cached one, or one started now; `pin` keeps it cached for good."""
        with self._lock:
            pinned = self._pinned.get(spec)
            if pinned is not None:
                return pinned
            future = self._futures.pop(spec, None)
            if future is None:
                future = self._pool.submit(self.backend.compile, spec)
                self.compiles += 1
            if pin:
                self._pinned[spec] = future
                return future
            self._futures[spec] = future  # the last used: at the end
            while len(self._futures) > self.cached:
                self._futures.popitem(last=False)
            return future

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> Any:
        """The compiled grammar; GrammarError when the spec is invalid or its compile outlasts the time limit."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self.submit(spec).result(limit)
        except FutureTimeout:
            raise GrammarError(f"the {KIND_WORDS.get(spec.kind, 'grammar')} did not compile within {limit:g} s; "
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
    grammar: str | None = PydanticField(None, description="a GBNF grammar whose start rule is root (or, with the "
                                        "guidance backend, a Lark grammar whose start rule is start)")
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
