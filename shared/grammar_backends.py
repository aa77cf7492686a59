"""The grammar libraries' names, and llguidance behind `blink.shared.grammar.Backend`.

`--structured-outputs-backend` names the engine's library (vLLM's backend names: `guidance`, `xgrammar`). llguidance
has no required dependency, so the ingress (the SmartNIC's side, no torch) checks every spec with it, whatever the
engine masks with; xgrammar imports torch and transformers, so it lives with the engine
(blink.engine.core.xgrammar_backend, `pip install blink-serve[xgrammar]`). The library is imported when a backend is
made, never by this module. Both fill the same bitmask: int32 words, one row per request, bit b of word w allowing
token 32 * w + b.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from blink.shared.grammar import (
    KIND_WORDS,
    NAMED_SCHEMAS,
    VALUE_KEYWORDS,
    GrammarError,
    GrammarKind,
    GrammarSpec,
)

BACKENDS = ("guidance", "xgrammar")
DEFAULT_BACKEND = "guidance"
HELP = ("the library the engine masks structured outputs with (vLLM's names): guidance (llguidance) or xgrammar "
        "(pip install blink-serve[xgrammar]); the ingress checks specs with llguidance either way")
MAX_WHITESPACE = 4  # whitespace characters in a row a JSON answer may hold (a model drifting into blank space)


def guidance(tokenizer: Any, vocab_size: int, stop_ids: list[int], max_whitespace: int = MAX_WHITESPACE) -> LLGuidance:
    """llguidance over a `tokenizers` Tokenizer (blink.shared.tokenizer.Tokenizer's `raw`), for a model of
    `vocab_size` logits (the tokenizer's vocabulary padded, maybe) that stops on `stop_ids`. GrammarError when the
    model has no end token (a complete grammar allows only it, so no answer could end); ImportError when the library
    is not installed."""
    check_stop_ids(stop_ids)
    return LLGuidance(tokenizer, vocab_size, list(stop_ids), max_whitespace)


def check_stop_ids(stop_ids: list[int]) -> None:
    if not stop_ids:
        raise GrammarError("this model has no end-of-sequence token, so a structured output could never end")


class LLGuidance:
    """llguidance (vLLM's `guidance` backend). A compile builds a matcher (the lexer and parser tables, off the GIL)
    and checks it; each request's matcher is a copy of it. A `grammar` is GBNF (as xgrammar takes it) or Lark
    (llguidance's own), told apart by llguidance; a choice is the GBNF of its literals. A JSON object schema that
    does not say allows no properties beyond those it names, as xgrammar's strict mode does (vLLM's
    disable_additional_properties), so both backends answer alike."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], max_whitespace: int):
        import llguidance

        self._llg = llguidance
        # From the tokenizer's JSON, as llguidance.hf does with transformers' copy of it.
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=stop_ids)
        self._json_options = {"whitespace_flexible": True,
                              "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{max_whitespace}}}"}

    def compile(self, spec: GrammarSpec) -> Any:
        matcher_of = self._llg.LLMatcher
        try:
            if spec.kind == GrammarKind.JSON_SCHEMA:
                schema = _closed(json.loads(spec.text))
                grammar = matcher_of.grammar_from_json_schema(schema, defaults=self._json_options)
            elif spec.kind == GrammarKind.REGEX:
                grammar = matcher_of.grammar_from_regex(spec.text)
            elif spec.kind == GrammarKind.EBNF:
                grammar = self._llg.grammar_from("grammar", spec.text)
            else:
                raise GrammarError(f"unknown grammar kind {int(spec.kind)}")
        except (ValueError, TypeError) as e:  # not JSON, or a GBNF its converter could not read
            raise GrammarError(f"invalid {KIND_WORDS[spec.kind]}: {first_line(e)}") from None
        matcher = matcher_of(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():  # llguidance reports a bad grammar in the matcher, never by raising
            raise GrammarError(f"invalid {KIND_WORDS[spec.kind]}: {_llg_message(matcher.get_error())}")
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row]
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)  # into the row, off the GIL

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


def _closed(schema: Any) -> Any:
    """`schema` with additionalProperties false wherever an object lists its properties and says nothing of others
    (vLLM's walk for the guidance backend; JSON Schema's own default allows any)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in VALUE_KEYWORDS:  # data, kept as it is
            closed[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):  # names, each of a schema
            closed[key] = {name: _closed(sub) for name, sub in value.items()}
        else:
            closed[key] = _closed(value)
    if "additionalProperties" not in closed and ("properties" in schema or "patternProperties" in schema):
        closed["additionalProperties"] = False
    return closed


def first_line(e: BaseException | str) -> str:
    """The library's message without its source location ("[time] file.cc:line: ") or its state dump."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text.split(": ", 1)[1][:300] if text.startswith("[") and ": " in text else text[:300]


def _llg_message(error: str) -> str:
    """llguidance's error without its parser-state dump: the first line and the lines that say what is wrong."""
    lines = [line.strip() for line in error.split("<state>")[0].splitlines() if line.strip()]
    said = [lines[0], *(line for line in lines[1:] if line.startswith("error:"))] if lines else ["rejected"]
    return " ".join(said)[:300]


# The device modes' grammar walk (blink.engine.core.grammar_table) takes what lowers to a regular language: a
# regex, a choice, a JSON schema through outlines-core's regex of it (whitespace: one optional space where JSON
# allows any, a subset of what llguidance allows, so every answer the walk makes is one the ingress's check accepts).
DEVICE_WHITESPACE = r"[ ]?"
GRAMMAR_ARENA_BYTES = 64 << 20  # --grammar-arena-bytes: device memory for every resident grammar's table together


def device_regex(spec: GrammarSpec) -> str:
    """The regex the device modes walk for `spec`; GrammarError saying why when it has none (a GBNF or Lark grammar,
    which is not regular; a schema keyword outlines-core cannot express). ImportError without outlines-core."""
    if spec.kind == GrammarKind.REGEX:
        return ascii_classes(spec.text)
    if spec.kind == GrammarKind.EBNF:
        options = choice_options(spec.text)
        if options is None:
            raise GrammarError("a grammar is not walked on the device (graph and persistent drive modes); a regex, "
                               "a choice or a JSON schema is, and the host drive mode serves grammars")
        return "|".join(_escape(option) for option in options)
    if spec.kind != GrammarKind.JSON_SCHEMA:
        raise GrammarError(f"unknown grammar kind {int(spec.kind)}")
    from outlines_core.json_schema import build_regex_from_schema

    integers = _Integers(spec.text)
    schema, where = _device_schema(json.loads(spec.text), "#", integers)
    if where is not None:
        raise GrammarError(f"the JSON schema keyword at {where[:200]} is not enforced by the device's grammar walk "
                           "(graph and persistent drive modes); the host drive mode serves it")
    try:
        regex = build_regex_from_schema(json.dumps(schema), DEVICE_WHITESPACE)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema cannot be walked on the device (graph and persistent drive modes): "
                           f"{first_line(e)}; the host drive mode serves it") from None
    return ascii_classes(integers.substitute(regex))


def choice_options(text: str) -> list[str] | None:
    """The options of a grammar GrammarSpec.choice wrote (`root ::= "a" | "b"`), or None for any other grammar."""
    prefix, decoder, options, at = "root ::= ", json.JSONDecoder(), [], 0
    if not text.startswith(prefix):
        return None
    at = len(prefix)
    while True:
        try:
            option, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        if not isinstance(option, str):
            return None
        options.append(option)
        if at == len(text):
            return options
        if not text.startswith(" | ", at):
            return None
        at += 3


def _escape(literal: str) -> str:
    """`literal` matched as it is by outlines-core's regex syntax (Rust's: Python's re.escape escapes alike)."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in literal)


# Keywords outlines-core's regex leaves out (checked by hand on 0.2.14: the regex is the same without them).
DEVICE_UNENFORCED = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                               "uniqueItems", "minProperties", "maxProperties", "patternProperties", "propertyNames"})
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
RANGE_AS_ENUM = 1024  # an integer range at most this wide becomes the enum of its values, which the regex enforces
# Digits of a bounded integer on the device (as outlines-core's minDigits/maxDigits would bound them): what an int64
# holds, and a model that writes digits on and on must end the number there.
INTEGER_DIGITS = 18


def _device_schema(schema: Any, path: str, integers: _Integers) -> tuple[Any, str | None]:
    """`schema` with each bounded integer as the enum of its values (a range at most RANGE_AS_ENUM wide) or as a
    stand-in for its regex (`integers`), and where the first keyword of DEVICE_UNENFORCED still is (None: nowhere)."""
    if isinstance(schema, list):
        items = [_device_schema(item, f"{path}/{i}", integers) for i, item in enumerate(schema)]
        return [item for item, _ in items], next((w for _, w in items if w is not None), None)
    if not isinstance(schema, dict):
        return schema, None
    schema = _integer_range(schema, path, integers)
    out, found = {}, None
    for key, value in schema.items():
        if key in DEVICE_UNENFORCED and found is None:
            found = f"{path}/{key}"
        if key in VALUE_KEYWORDS:
            out[key] = value
            continue
        if key in NAMED_SCHEMAS and isinstance(value, dict):
            subs = {name: _device_schema(sub, f"{path}/{key}/{name}", integers) for name, sub in value.items()}
            out[key] = {name: sub for name, (sub, _) in subs.items()}
            where = next((w for _, w in subs.values() if w is not None), None)
        else:
            out[key], where = _device_schema(value, f"{path}/{key}", integers)
        found = found or where
    return out, found


def _integer_range(schema: dict, path: str, integers: _Integers) -> dict:
    """An integer schema with bounds as what outlines-core enforces: a range at most RANGE_AS_ENUM wide as the enum
    of its values (multipleOf too), any other (one bound, or a wider range, without multipleOf) as a stand-in for
    integer_regex's. Left as it is where a bound is not a number or another keyword decides the value."""
    bounds = {key: schema[key] for key in BOUNDS if key in schema}
    if (schema.get("type") != "integer" or not bounds or "enum" in schema or "const" in schema
            or not all(type(v) in (int, float) and math.isfinite(v) for v in bounds.values())):
        return schema  # a draft-4 boolean exclusiveMinimum too: refused, its keyword named
    low, high = _integer_bounds(bounds)
    step = schema.get("multipleOf", 1)
    rest = {k: v for k, v in schema.items() if k not in ("type", *BOUNDS, "multipleOf")}
    if None not in (low, high) and type(step) is int and step > 0 and high - low <= RANGE_AS_ENUM:
        values = [v for v in range(low, high + 1) if v % step == 0]
        if not values:  # an empty enum would lower to an empty regex: `{"a":}` for an optional property
            raise GrammarError(f"the integer bounds at {path[:200]} admit no integer")
        return {**rest, "enum": values}
    if step != 1:  # divisibility over an open range: not lowered
        return schema
    regex = integer_regex(low, high)
    if regex is None:
        raise GrammarError(f"the integer bounds at {path[:200]} admit no integer of at most {INTEGER_DIGITS} digits, "
                           "the most the device's grammar walk writes (graph and persistent drive modes); the host "
                           "drive mode serves them")
    return {**rest, "const": integers.stand_in(regex)}


def _integer_bounds(bounds: dict) -> tuple[int | None, int | None]:
    """The least and greatest integers `bounds` (JSON schema's, numbers) allow; None: no bound that way."""
    lows = [math.ceil(bounds["minimum"])] if "minimum" in bounds else []
    lows += [math.floor(bounds["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in bounds else []
    highs = [math.floor(bounds["maximum"])] if "maximum" in bounds else []
    highs += [math.ceil(bounds["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in bounds else []
    return max(lows, default=None), min(highs, default=None)


def integer_regex(low: int | None, high: int | None) -> str | None:
    """The regex of the JSON integers from `low` to `high` (None: unbounded that way) of at most INTEGER_DIGITS
    digits, written as JSON writes them (no leading zeros; no -0, as llguidance's bounded integers); None when there
    is none."""
    top = 10 ** INTEGER_DIGITS - 1
    low, high = max(-top, -top if low is None else low), min(top, top if high is None else high)
    if low > high:
        return None
    parts = []
    if low < 0:  # the negatives' magnitudes, from the least to the greatest
        negatives = _magnitudes(max(1, -high), -low)
        parts.append("-" + (negatives[0] if len(negatives) == 1 else f"({'|'.join(negatives)})"))
    if high >= 0:
        parts += _magnitudes(max(0, low), high)
    return f"({'|'.join(parts)})"


def _magnitudes(low: int, high: int) -> list[str]:
    """Alternatives that match the naturals from `low` to `high` (0 <= low <= high), without leading zeros: per count
    of digits, the counts whose every number is in range as one class."""
    out, full = [], []
    if low == 0:
        out.append("0")
        low = 1
    for digits in range(len(str(low)), len(str(high)) + 1) if low <= high else ():
        first, last = max(low, 10 ** (digits - 1)), min(high, 10 ** digits - 1)
        if (first, last) == (10 ** (digits - 1), 10 ** digits - 1):
            full.append(digits)  # contiguous: only the shortest and the longest counts can be partial
        else:
            out += _same_length(str(first), str(last))
    if full:
        out.append("[1-9]" + _repeat(full[0] - 1, full[-1] - 1))
    return out


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives that match the digit strings from `low` to `high`, both of one length, low <= high."""
    if low == high:
        return [low]
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [low[0] + tail for tail in _same_length(low[1:], high[1:])]
    rest, out, tail = len(low) - 1, [], []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * rest:  # low's leading digit, then from its tail up
        out += [low[0] + t for t in _same_length(low[1:], "9" * rest)]
        first += 1
    if high[1:] != "9" * rest:  # high's leading digit, then up to its tail
        tail = [high[0] + t for t in _same_length("0" * rest, high[1:])]
        last -= 1
    if first <= last:
        out.append((str(first) if first == last else f"[{first}-{last}]") + _repeat(rest, rest))
    return out + tail


def _repeat(least: int, most: int) -> str:
    """[0-9] from `least` to `most` times."""
    if most == 0:
        return ""
    return "[0-9]" + ("" if (least, most) == (1, 1) else f"{{{least}}}" if least == most else f"{{{least},{most}}}")


class _Integers:
    """Integer regexes outlines-core has no keyword for (integer_regex's), each stood in for in the schema by a const
    string whose quoted text its regex then replaces: a number, unquoted, where the value goes."""

    def __init__(self, text: str):
        self.tag = "blinkinteger"
        while self.tag in text:  # a name the schema's own strings do not hold
            self.tag += "x"
        self.regexes: dict[str, str] = {}

    def stand_in(self, regex: str) -> str:
        name = f"{self.tag}{len(self.regexes)}"
        self.regexes[json.dumps(name)] = regex
        return name

    def substitute(self, regex: str) -> str:
        for quoted, integer in self.regexes.items():
            regex = regex.replace(quoted, integer)
        return regex


# Perl classes as ASCII, as llguidance reads them: Rust's regex (outlines-core's) reads them as Unicode, so a date's
# \d would take Arabic-Indic digits.
ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(regex: str) -> str:
    """`regex` with each \\d, \\w and \\s (outside a class or in one) as its ASCII class; \\D, \\W, \\S as they are."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            ascii_class = ASCII_CLASSES.get(nxt)
            out.append(ascii_class if ascii_class and in_class else f"[{ascii_class}]" if ascii_class else c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            if regex[i + 1:i + 2] == "^":
                out.append("^")
                i += 1
            if regex[i + 1:i + 2] == "]":  # a leading ] is a literal
                out.append("]")
                i += 1
        elif c == "]" and in_class:
            in_class = False
            out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)
