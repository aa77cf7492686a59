"""The device modes' grammars lowered on the host (blink.engine.core.grammar_table, outlines-core): random walks of a
regex's, a choice's and JSON schemas' tables make strings that match or parse; the table's masks agree with
llguidance's (the ingress's check, the host mode's default) on sampled prefixes, but where the two libraries differ
by design; integer bounds lower to exactly their integers; what does not lower is refused saying why."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest

from blink.engine.core.grammar_table import Lowering, allowed, walk
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.grammar import GrammarError, GrammarKind, GrammarSpec
from blink.shared.grammar_backends import choice_options, device_regex, guidance
from blink.shared.tokenizer import Tokenizer

VOCAB, EOS = 1174, 1  # the tiny model's
REGEX = r"[a-c]{3,6}(x|yz)?"
CHOICES = ["cat", "dog", "a bird", "x|y (z)"]
SCHEMAS = [
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 20},
                                      "name": {"type": "string", "maxLength": 4}}, "required": ["kind", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1,
                                               "maxItems": 2},
                                      "id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3},
                                                       {"type": "boolean"}]},
                                      "day": {"type": "string", "format": "date"},
                                      "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                "required": ["ok"]}},
     "required": ["tags", "id", "inner"]},
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(ensure_tiny_model())


@pytest.fixture(scope="module")
def lowering(tokenizer):
    return Lowering(tokenizer.raw, VOCAB, [EOS])


def _walks(table, seed: int, count: int = 25, limit: int = 300):
    """Token lists walked through the table at random (the end token taken a third of the times it is allowed)."""
    rng = random.Random(seed)
    for _ in range(count):
        state, tokens = table.start, []
        for _ in range(limit):
            choices = allowed(table, state).tolist()
            assert choices, "a state of the walk allows nothing"
            token = EOS if EOS in choices and (rng.random() < 0.35 or len(choices) == 1) else rng.choice(
                [t for t in choices if t != EOS])
            if token == EOS:
                break
            tokens.append(token)
            state = walk(table, state, token)
            assert state >= 0
        else:
            raise AssertionError("the walk did not end")
        yield tokens


def test_walks_of_a_regex_and_a_choice_match_them(lowering, tokenizer):
    table = lowering.lower(GrammarSpec(GrammarKind.REGEX, REGEX))
    for tokens in _walks(table, 0):
        assert re.fullmatch(REGEX, tokenizer.decode(tokens)), tokenizer.decode(tokens)
    spec = GrammarSpec.choice(CHOICES)
    assert choice_options(spec.text) == CHOICES
    table = lowering.lower(spec)
    seen = {tokenizer.decode(tokens) for tokens in _walks(table, 1, count=40)}
    assert seen <= set(CHOICES) and len(seen) >= 3


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum_range_string", "array_anyof_date_nested"])
def test_walks_of_a_json_schema_parse_under_it(lowering, tokenizer, schema):
    table = lowering.lower(GrammarSpec.json_schema(schema))
    assert table.masks < table.states  # states share their masks
    for tokens in _walks(table, 2):
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)


def test_the_tables_masks_agree_with_llguidance_but_where_the_libraries_differ(lowering, tokenizer):
    """Equal for a regex. For JSON and choices: the table allows the text llguidance forces spelt in other tokens,
    which llguidance (canonical tokenizations of forced text only) refuses; llguidance allows up to 4 whitespace
    characters where JSON allows any, the table one space where outlines-core's regex has one
    (blink.shared.grammar_backends.DEVICE_WHITESPACE). Both allow the end at the same places."""
    import llguidance

    backend = guidance(tokenizer.raw, VOCAB, [EOS])
    spelling = llguidance.LLTokenizer(tokenizer.raw.to_str(), n_vocab=VOCAB, eos_token=[EOS])
    rng = random.Random(3)
    for spec in (GrammarSpec(GrammarKind.REGEX, REGEX), GrammarSpec.choice(CHOICES),
                 *(GrammarSpec.json_schema(schema) for schema in SCHEMAS)):
        table, compiled, compared = lowering.lower(spec), backend.compile(spec), 0
        for _ in range(12):
            matcher, state, tokens = backend.matcher(compiled), table.start, []
            for _ in range(80):
                mine = set(allowed(table, state).tolist())
                words = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
                backend.fill(matcher, words, 0)
                theirs = set(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB]).tolist())
                compared += 1
                assert (EOS in mine) == (EOS in theirs)
                if spec.kind == GrammarKind.REGEX:
                    assert mine == theirs
                forced = bytes(matcher.compute_ff_bytes())  # the text llguidance forces here: spelt otherwise
                assert all(forced.startswith(spelling.decode_bytes([t])) for t in mine - theirs), spec
                # llguidance's whitespace: tokens that start with some, or follow some (the table allows one space,
                # and only where outlines-core's regex puts it)
                spaced = tokenizer.decode(tokens)[-1:].isspace()
                assert spaced or all(tokenizer.decode([t])[0].isspace() for t in theirs - mine), spec
                both = sorted(mine & theirs)
                if EOS in both and (rng.random() < 0.3 or len(both) == 1):
                    break
                token = rng.choice([t for t in both if t != EOS])
                assert backend.accept(matcher, token)
                state = walk(table, state, token)
                tokens.append(token)
        assert compared > 30, spec


@pytest.mark.parametrize(("spec", "words"), [
    (GrammarSpec(GrammarKind.EBNF, 'root ::= "a" root | "b"'), "a grammar is not walked on the device"),
    (GrammarSpec.json_schema({"type": "number", "minimum": 0}), "#/minimum is not enforced"),
    (GrammarSpec.json_schema({"type": "integer", "minimum": 0, "multipleOf": 2}), "#/minimum is not enforced"),
    (GrammarSpec.json_schema({"type": "integer", "minimum": 5, "exclusiveMinimum": True}), "#/minimum"),  # draft 4
    (GrammarSpec.json_schema({"properties": {"n": {"type": "integer", "minimum": 10 ** 18}}}),
     "bounds at #/properties/n admit no integer of at most 18 digits"),
    # An empty range (an optional property's once lowered to `{"a":}`), and one with no multiple in it.
    (GrammarSpec.json_schema({"properties": {"a": {"type": "integer", "minimum": 5, "maximum": 3}}}),
     "bounds at #/properties/a admit no integer"),
    (GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 7, "multipleOf": 4}), "admit no integer"),
    (GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "uniqueItems"),
    (GrammarSpec.json_schema({"type": "string", "format": "hostname"}), "hostname"),
    (GrammarSpec(GrammarKind.REGEX, "(?=a)b"), "cannot be walked on the device"),
])
def test_what_does_not_lower_is_refused_saying_why(lowering, spec, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        lowering.lower(spec)


def test_perl_classes_are_ascii_as_llguidance_reads_them():
    """Rust's regex (outlines-core's) reads \\d as any Unicode digit: a date would take Arabic-Indic ones."""
    regex = device_regex(GrammarSpec.json_schema({"type": "string", "format": "date"}))
    assert re.fullmatch(regex, '"2024-01-31"') and not re.fullmatch(regex, '"\u0662024-01-31"')
    assert device_regex(GrammarSpec(GrammarKind.REGEX, r"[\d.]+\\d\D")) == r"[0-9.]+\\d\D"


def test_a_bounded_integer_range_becomes_its_values():
    regex = device_regex(GrammarSpec.json_schema({"type": "integer", "minimum": 2, "maximum": 9, "multipleOf": 3}))
    assert {v for v in map(str, range(-5, 40)) if re.fullmatch(regex, v)} == {"3", "6", "9"}


# Integer bounds outlines-core leaves out, as the device walks them: one-sided, exclusive, fractional, wide.
BOUNDS = [
    {"minimum": 0}, {"minimum": 17}, {"minimum": -5}, {"maximum": 0}, {"maximum": -1}, {"maximum": 12345},
    {"exclusiveMinimum": 0}, {"exclusiveMaximum": -10}, {"minimum": 0.5}, {"exclusiveMinimum": 2.5},
    {"minimum": -987, "maximum": 4321}, {"minimum": 0, "exclusiveMinimum": 7, "maximum": 10 ** 20},
    {"minimum": 123456789012}, {"maximum": -(10 ** 17)}, {"minimum": 999, "maximum": 100000, "multipleOf": 1},
]


def _sampled(bounds: dict) -> set[int]:
    """Integers in and around the bounds: each bound and its neighbours, powers of ten, the 18-digit limits, and
    random ones of every length."""
    rng = random.Random(str(bounds))
    near = {int(v) + d for v in bounds.values() if abs(v) < 10 ** 21 for d in (-2, -1, 0, 1, 2)}
    powers = {sign * (10 ** k + d) for k in range(20) for d in (-1, 0) for sign in (1, -1)}
    return near | powers | {rng.choice((1, -1)) * rng.randrange(10 ** rng.randint(1, 19)) for _ in range(2000)}


@pytest.mark.parametrize("bounds", BOUNDS, ids=[",".join(f"{k}={v}" for k, v in b.items()) for b in BOUNDS])
def test_integer_bounds_lower_to_exactly_their_integers(bounds):
    """Every sampled integer in range of at most 18 digits matches, as JSON writes it; none out of range does, nor a
    leading zero or -0 (which llguidance, the ingress's check, refuses for a bounded integer)."""
    schema = {"type": "integer", **bounds}
    regex = device_regex(GrammarSpec.json_schema(schema))
    for value in _sampled(bounds):
        try:
            jsonschema.validate(value, schema)
            inside = abs(value) < 10 ** 18
        except jsonschema.ValidationError:
            inside = False
        assert bool(re.fullmatch(regex, str(value))) == inside, (value, regex)
        if value > 0:
            assert not re.fullmatch(regex, f"0{value}") and not re.fullmatch(regex, f"-0{value}")
    assert not re.fullmatch(regex, "-0") and not re.fullmatch(regex, "00")
    assert not any(re.fullmatch(regex, s) for s in ("+1", "1.0", "1e2", '"1"', " 1"))


def test_a_pydantic_model_s_one_sided_bounds_lower_and_walk_within_them(lowering, tokenizer):
    """Field(ge=0) and Field(lt=0) as pydantic writes them, lowered to a table whose walks parse under the schema."""
    from pydantic import BaseModel, Field

    class Count(BaseModel):
        n: int = Field(ge=0)
        debt: int = Field(lt=0)
        small: int | None = Field(None, gt=3)

    schema = Count.model_json_schema()
    table = lowering.lower(GrammarSpec.json_schema(schema))
    seen = 0
    for tokens in _walks(table, 4, count=40):
        value = json.loads(tokenizer.decode(tokens))
        jsonschema.validate(value, schema)
        seen += value["n"] > 9 or value["debt"] < -9  # numbers of more than one digit came up
    assert seen


def test_the_ingress_lets_the_device_modes_take_what_lowers():
    """graph and persistent take a regex, a choice, a schema and a one-sided integer bound (the engine walks them),
    and refuse, naming why, what does not lower; the host mode masks a GBNF grammar."""
    from types import SimpleNamespace

    from blink.ingress.errors import APIError
    from blink.ingress.structured import _check_serving

    regular = [GrammarSpec(GrammarKind.REGEX, REGEX), GrammarSpec.choice(CHOICES), GrammarSpec.json_schema(SCHEMAS[1]),
               GrammarSpec.json_schema({"type": "integer", "minimum": 0})]
    gbnf = GrammarSpec(GrammarKind.EBNF, 'root ::= "a" root | "b"')
    for drive in ("graph", "persistent"):
        state = SimpleNamespace(info=SimpleNamespace(drive=drive, max_grammar_bytes=4096))
        for spec in regular:
            _check_serving(state, spec, "structured_outputs")
        with pytest.raises(APIError, match="host drive mode serves grammars"):
            _check_serving(state, gbnf, "structured_outputs")
    _check_serving(SimpleNamespace(info=SimpleNamespace(drive="host", max_grammar_bytes=4096)), gbnf, "x")
