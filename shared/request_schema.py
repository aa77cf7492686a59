"""The request record, declared once.

Each field of a request as it crosses the slot table: its name, its type in a slot record, its default, its
limits, and the engine state tensor it lands in. Everything else derives from this table: the record's layout
(blink.shared.slot_table), the `Request` the ingress publishes, the limits the ingress and the offline API
validate (and so the OpenAPI schema), the engine's per-slot state tensors and the one admission that copies a
record into them (blink.engine.core.admission, on the host and on the device).

A *knob* is a sampling parameter that means the same everywhere: the same name in the OpenAI body, in
`SamplingParams`, in the record and in the engine's state, copied as it is. Adding one is a line in FIELDS, its
declaration in `Request` and in `blink.engine.core.state.Slots` (tests/engine/test_admission.py holds both to FIELDS and
prints the lines to write), and the sampler code that reads `state.<name>`. The other fields have their own
shapes at the edges (an optional seed, a class name, SLOs in ms that become a deadline) and their own line in the
admission.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import MISSING, dataclass
from typing import Annotated

import numpy as np
from pydantic import AfterValidator, ConfigDict, StrictBool, StrictFloat, StrictInt, create_model, field_validator
from pydantic import Field as PydanticField

from blink.shared.grammar import GrammarSpec

MAX_STOP_IDS = 16  # stop token ids a request may give
MAX_LOGPROBS = 20  # top logprobs a request may ask for per token
MAX_LOGIT_BIAS = 128  # tokens a request may bias
MAX_GRAMMAR_BYTES = 16384  # a record's grammar area (--max-grammar-bytes): a structured output's spec, UTF-8
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias: [-100, 100]
INT32_MAX = 2**31 - 1
INF = float("inf")


@dataclass(frozen=True)
class RequestField:
    name: str
    wire: str  # numpy dtype of the field in a slot record
    default: float | int | bool
    state: str | None = None  # dtype of the engine's per-slot tensor of the same name; None: the record's only
    knob: bool = False  # a sampling parameter that is copied as it is, everywhere (see the module's docstring)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    doc: str = ""

    @property
    def python_type(self) -> type:
        return bool if self.state == "bool" else float if self.wire[1] == "f" else int

    def limits(self) -> dict[str, float]:
        return {k: v for k in ("ge", "gt", "le", "lt") if (v := getattr(self, k)) is not None}


# In record order. The record's other parts (control words, the prompt, the output window) are the slot table's.
FIELDS: tuple[RequestField, ...] = (
    RequestField("prompt_len", "<u4", 0, "int64", doc="tokens in the prompt"),
    RequestField("max_tokens", "<u4", 16, "int64", ge=0,
                 doc="tokens to generate at most (the context caps it); 0: none, the prompt's logprobs only"),
    RequestField("priority", "<i4", 0, "int64", knob=True, ge=-(2**15), lt=2**15,
                 doc="lower runs first (vLLM's priority scheduling)"),
    RequestField("ignore_eos", "<u4", False, "bool", knob=True, doc="generate past the end-of-sequence token"),
    RequestField("temperature", "<f4", 1.0, "float32", knob=True, ge=0.0, le=2.0, doc="0: greedy"),
    RequestField("top_p", "<f4", 1.0, "float32", knob=True, gt=0.0, le=1.0),
    RequestField("top_k", "<i4", 0, "int64", knob=True, ge=-1, le=INT32_MAX, doc="0 or -1: off"),
    RequestField("min_p", "<f4", 0.0, "float32", knob=True, ge=0.0, le=1.0),
    RequestField("repetition_penalty", "<f4", 1.0, "float32", knob=True, gt=0.0, le=10.0,
                 doc="over prompt and output tokens"),
    RequestField("presence_penalty", "<f4", 0.0, "float32", knob=True, ge=-2.0, le=2.0),
    RequestField("frequency_penalty", "<f4", 0.0, "float32", knob=True, ge=-2.0, le=2.0),
    RequestField("logprobs", "<i4", -1, "int64", ge=-1, le=MAX_LOGPROBS, doc="top logprobs per token; -1: none"),
    RequestField("prompt_logprobs", "<i4", -1, "int64", ge=-1, le=MAX_LOGPROBS,
                 doc="top logprobs per prompt token; -1: none. The engine publishes the prompt's tokens after the "
                     "first, each with its logprob given those before it, ahead of the generated ones"),
    RequestField("seed", "<u8", 0, "int64", ge=0, lt=2**63, doc="of the request's random draws"),
    RequestField("service_class", "<u4", 0, "int64", doc="blink.shared.service_class.ServiceClass"),
    RequestField("ttft_slo_ms", "<f4", INF, gt=0.0,
                 doc="what remains of the TTFT SLO when the request is published; inf: none (lands as "
                     "ttft_deadline)"),
    RequestField("tpot_slo_ms", "<f4", INF, gt=0.0, doc="inf: none (lands as tpot_slo, in seconds)"),
    RequestField("num_stop_ids", "<u4", 0, doc="how many of stop_ids are given"),
    RequestField("num_logit_bias", "<u4", 0, doc="how many of logit_bias_ids (and their biases) are given"),
    RequestField("min_tokens", "<u4", 0, "int64", knob=True, ge=0, le=INT32_MAX,
                 doc="tokens generated before the end-of-sequence token, a stop id or a stop string may end the "
                     "request (vLLM's)"),
    RequestField("grammar_kind", "<u4", 0, doc="blink.shared.grammar.GrammarKind of the record's grammar; 0: none"),
    RequestField("grammar_len", "<u4", 0, doc="bytes of the grammar area its spec takes"),
    RequestField("reasoning_end_id", "<i4", -1, ge=-1, lt=2**31,
                 doc="the token that ends a thinking model's reasoning: its grammar masks only after it (vLLM's "
                     "structured outputs with a reasoning parser); -1: from the first token"),
)
BY_NAME = {f.name: f for f in FIELDS}
KNOBS = tuple(f for f in FIELDS if f.knob)
# Where the fields of FIELDS sit: a span of the record from FIRST up to (not including) the prompt, stop ids
# included, which admission copies whole.
FIRST = FIELDS[0].name


def record_fields(max_stop_ids: int, max_page_hashes: int) -> list[tuple]:
    """The request's part of a slot record (numpy dtype entries), its arrays last: the stop ids, the biased
    tokens and their biases (OpenAI's logit_bias), and the prompt's page hashes (blink.shared.prefix_hash: what
    prefix caching looks up; one per full page of the prompt)."""
    return [*((f.name, f.wire) for f in FIELDS), ("stop_ids", "<i4", (max_stop_ids,)),
            ("logit_bias_ids", "<i4", (MAX_LOGIT_BIAS,)), ("logit_bias", "<f4", (MAX_LOGIT_BIAS,)),
            ("page_hashes", "<i8", (max(1, max_page_hashes),))]


def request_fields() -> list[tuple[str, object, object]]:
    """(name, type, default) of each attribute of `Request`, as FIELDS makes them: the prompt, max_tokens, every field
    of FIELDS but those derived from the prompt and the arrays, then the arrays, the cache salt and the grammar.
    `Request` declares them in its source, for an editor to see; tests/engine/test_admission.py checks the two agree."""
    derived = {"prompt_len", "num_stop_ids", "num_logit_bias", "grammar_len"}
    return [("prompt", list[int], MISSING), ("max_tokens", int, MISSING),
            *((f.name, f.python_type, f.default) for f in FIELDS if f.name not in derived | {"max_tokens"}),
            ("stop_token_ids", tuple[int, ...], ()), ("logit_bias", tuple[tuple[int, float], ...], ()),
            ("cache_salt", str, ""), ("grammar", str, "")]


def grammar_area(max_grammar_bytes: int) -> tuple:
    """The record's grammar area (numpy dtype entry), after the prompt: outside what admission copies, read by the
    host once per constrained request (blink.engine.core.grammar)."""
    return ("grammar", "u1", (max_grammar_bytes,))


@dataclass
class Request:
    """What the ingress writes into a slot: the prompt, max_tokens, then every field of FIELDS with its default
    (`logprobs` -1: none; `ttft_slo_ms`: what remains of the SLO at publication, inf: none), the stop token ids, the
    logit biases ((token id, bias) pairs), the cache salt (vLLM's: requests share cached KV pages only with
    requests of the same salt; it goes into the page hashes, not the record) and the grammar's text (structured
    outputs: blink.shared.grammar.GrammarSpec, its kind in grammar_kind).

    Written out as `request_fields()` generates them from FIELDS (a test holds the two equal): a new field of FIELDS
    is a line here too, which that test's failure spells out."""

    prompt: list[int]
    max_tokens: int
    priority: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int = -1
    prompt_logprobs: int = -1
    seed: int = 0
    service_class: int = 0
    ttft_slo_ms: float = INF
    tpot_slo_ms: float = INF
    min_tokens: int = 0
    grammar_kind: int = 0
    reasoning_end_id: int = -1
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    cache_salt: str = ""
    grammar: str = ""


def _pydantic_knob(f: RequestField) -> tuple:
    kind = {bool: StrictBool, int: StrictInt, float: StrictFloat}[f.python_type]
    extra = {"allow_inf_nan": False} if f.python_type is float else {}
    if f.python_type is float:
        kind = Annotated[kind, AfterValidator(functools.partial(_as_stored, f))]
    return kind, PydanticField(f.default, **f.limits(), **extra, description=f.doc or None)


def _as_stored(f: RequestField, value: float) -> float:
    """A float knob within its limits as the record stores it (a 32-bit float), not only as sent: a top_p of 1e-46
    is above 0 but is 0 in the record, which no sampler can serve."""
    stored = float(np.array(value, dtype=f.wire))
    if not all(op(stored, bound) for op, bound in ((operator.ge, f.ge), (operator.gt, f.gt), (operator.le, f.le),
                                                   (operator.lt, f.lt)) if bound is not None):
        raise ValueError(f"{value!r} is {stored!r} as the 32-bit float the engine computes with, outside "
                         f"{f.name}'s limits {f.limits()}")
    return value


# The knobs as a pydantic model, the base of the request bodies at the edges (the OpenAI API's fields, the offline
# API's SamplingParams): their names, defaults and limits, and so the OpenAPI schema, come from FIELDS.
SamplingKnobs = create_model("SamplingKnobs", __config__=ConfigDict(extra="forbid"), __module__=__name__,
                             **{f.name: _pydantic_knob(f) for f in KNOBS})


class EdgeFields(SamplingKnobs):
    """What both edges take besides the knobs, with the same names and limits: the OpenAI bodies
    (blink.ingress.protocol) and the offline API's SamplingParams."""

    stop_token_ids: list[StrictInt] = PydanticField(default_factory=list, max_length=MAX_STOP_IDS)
    seed: StrictInt | None = PydanticField(None, ge=0, lt=2**63)
    prompt_logprobs: StrictInt | None = PydanticField(None, ge=0, le=MAX_LOGPROBS,
                                                      description="each prompt token's logprob and the top ones "
                                                                  "(vLLM's)")
    ttft_slo_ms: StrictFloat | None = PydanticField(None, gt=0, allow_inf_nan=False)
    tpot_slo_ms: StrictFloat | None = PydanticField(None, gt=0, allow_inf_nan=False)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(not 0 <= t <= INT32_MAX for t in v):  # the record's stop ids are int32
            raise ValueError("stop_token_ids must be token ids (non-negative, below 2**31)")
        return v


def logit_bias_pairs(bias: dict | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({token id, or its decimal string: bias}) as the record's (id, bias) pairs; a ValueError
    says what is wrong. Whether each id is in the vocabulary is the caller's check (it knows the model)."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased")
    pairs = []
    for key, value in bias.items():
        if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and key.isascii()
                                                                   and key.isdigit())):
            raise ValueError(f"logit_bias keys must be token ids, got {str(key)[:32]!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -LOGIT_BIAS_LIMIT <= value <= \
                LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        token = int(key)
        if token > INT32_MAX:
            raise ValueError("logit_bias keys must be token ids (below 2**31)")
        pairs.append((token, float(value)))
    pairs.sort()
    if (twice := next((a for (a, _), (b, _) in itertools.pairwise(pairs) if a == b), None)) is not None:
        raise ValueError(f"logit_bias names token {twice} more than once")
    return tuple(pairs)


def knobs_of(source: object) -> dict[str, object]:
    """The knobs' values of anything that has them as attributes (a request body, SamplingParams, a Request)."""
    return {f.name: getattr(source, f.name) for f in KNOBS}


def request_of(fields: EdgeFields, prompt: list[int], max_tokens: int, seed: int, service_class: int,
               ttft_slo_ms: float | None, tpot_slo_ms: float | None, logprobs: int | None,
               prompt_logprobs: int | None, cache_salt: str = "", grammar: GrammarSpec | None = None) -> Request:
    """The request a slot record carries, from what an edge validated (`fields`) and decided (the rest: the seed
    drawn when none was given, the class and SLOs resolved); what was not asked for is the record's -1 or inf."""
    def unless(value, none):
        return none if value is None else value

    return Request(
        prompt=prompt, max_tokens=max_tokens, seed=seed, service_class=service_class,
        logprobs=unless(logprobs, -1), prompt_logprobs=unless(prompt_logprobs, -1),
        ttft_slo_ms=unless(ttft_slo_ms, INF), tpot_slo_ms=unless(tpot_slo_ms, INF),
        stop_token_ids=tuple(fields.stop_token_ids), logit_bias=logit_bias_pairs(fields.logit_bias),
        cache_salt=cache_salt, grammar_kind=int(grammar.kind) if grammar else 0,
        grammar=grammar.text if grammar else "", **knobs_of(fields))
