"""Structured outputs' specs and compiles (blink.shared.grammar) and the ingress's checks (blink.ingress.structured),
without a model: the time limit, the cache by spec, the keywords refused, the record's grammar area, the drive modes
that walk no grammar."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from blink.ingress.errors import APIError
from blink.ingress.metrics import Metrics
from blink.ingress.structured import check_grammar
from blink.shared.grammar import GrammarCompiler, GrammarError, GrammarKind, GrammarSpec, StructuredOutputs
from blink.shared.request_schema import Request
from blink.shared.slot_table import Geometry, grammar_of, slot_dtype, write_request


class SlowBackend:
    """Compiles in `seconds`, counting its compiles; `bad` specs fail."""

    def __init__(self, seconds: float):
        self.seconds, self.calls, self.release = seconds, 0, threading.Event()

    def compile(self, spec: GrammarSpec) -> str:
        self.calls += 1
        self.release.wait(self.seconds)
        if spec.text == "bad":
            raise GrammarError("invalid regex: bad")
        return f"compiled {spec.text}"

    def matcher(self, compiled):
        return compiled


def test_a_compile_past_the_limit_is_refused_and_lands_in_the_cache_later():
    backend = SlowBackend(seconds=5)
    compiler = GrammarCompiler(backend, timeout_s=0.05)
    spec = GrammarSpec(GrammarKind.REGEX, "a+")
    started = time.monotonic()
    with pytest.raises(GrammarError, match=r"did not compile within 0\.05 s"):
        compiler.compile(spec)
    assert time.monotonic() - started < 2  # the caller was not held up for the compile
    backend.release.set()  # the compile finishes in its thread, into the cache
    assert compiler.compile(spec, timeout_s=5) == "compiled a+"
    assert backend.calls == 1 and compiler.compiles == 1
    compiler.close()


def test_one_compile_per_spec_and_errors_cached_too():
    backend = SlowBackend(seconds=0)
    compiler = GrammarCompiler(backend, cached=2)
    for _ in range(3):
        assert compiler.compile(GrammarSpec(GrammarKind.REGEX, "x")) == "compiled x"
        with pytest.raises(GrammarError, match="bad"):
            compiler.compile(GrammarSpec(GrammarKind.REGEX, "bad"))
    assert backend.calls == 2
    compiler.compile(GrammarSpec(GrammarKind.REGEX, "y"))
    compiler.compile(GrammarSpec(GrammarKind.REGEX, "z"))  # past 2 cached: the oldest goes
    compiler.compile(GrammarSpec(GrammarKind.REGEX, "x"))
    assert backend.calls == 5
    compiler.close()


def test_a_pinned_spec_outlives_the_cache_s_limit():
    backend = SlowBackend(seconds=0)
    compiler = GrammarCompiler(backend, cached=2)
    compiler.compile(GrammarSpec(GrammarKind.REGEX, "x"))
    compiler.submit(GrammarSpec(GrammarKind.REGEX, "x"), pin=True)  # pinned after it was cached: no second compile
    for text in "yzw":
        compiler.compile(GrammarSpec(GrammarKind.REGEX, text))
    assert compiler.compile(GrammarSpec(GrammarKind.REGEX, "x")) == "compiled x"
    assert backend.calls == 4 and len(compiler._futures) == 2  # the others still evicted past 2
    compiler.close()


@pytest.mark.parametrize(("schema", "where"), [
    ({"not": {"type": "string"}}, "#/not"),
    ({"type": "object", "properties": {"a": {"if": {"type": "string"}, "then": {}}}}, "#/properties/a/if"),
    ({"anyOf": [{"type": "integer"}, {"dependentRequired": {}}]}, "#/anyOf/1/dependentRequired"),
])
def test_keywords_xgrammar_would_not_enforce_are_refused(schema, where):
    with pytest.raises(GrammarError, match=where):
        GrammarSpec.json_schema(schema)


def test_property_names_and_enum_values_are_not_keywords():
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"not": {"enum": [{"if": 1}]}}})
    assert spec.kind == GrammarKind.JSON_SCHEMA


def test_vllm_s_structured_outputs_take_exactly_one():
    assert StructuredOutputs(choice=['a "b"', "c"]).spec().text == 'root ::= "a \\"b\\"" | "c"'
    assert StructuredOutputs(json_object=True).spec() == GrammarSpec.json_schema({"type": "object"})
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", grammar="root ::= \"a\"")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()


def test_the_record_carries_the_grammar_within_its_area():
    g = Geometry(2, 8, 4, max_grammar_bytes=16)
    records = np.zeros(2, dtype=slot_dtype(g))
    write_request(records[0], Request(prompt=[1, 2], max_tokens=3, grammar_kind=int(GrammarKind.REGEX),
                                      grammar="é[a-z]+"), g)
    assert grammar_of(records[0]) == GrammarSpec(GrammarKind.REGEX, "é[a-z]+")
    assert grammar_of(records[1]) is None
    with pytest.raises(ValueError, match="does not fit"):
        write_request(records[1], Request(prompt=[1], max_tokens=1, grammar_kind=2, grammar="x" * 17), g)


GBNF = GrammarSpec(GrammarKind.EBNF, 'root ::= "a" root | "b"')
UNBOUNDED = GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}})


@pytest.mark.parametrize(("drive", "limit", "spec", "words"), [
    ("graph", 4096, GBNF, "host drive mode"), ("persistent", 4096, UNBOUNDED, "#/properties/n/minimum"),
    ("host", 4, GrammarSpec(GrammarKind.REGEX, "[a-z]+"), "--max-grammar-bytes")])
def test_the_ingress_refuses_what_its_engine_cannot_mask(drive, limit, spec, words):
    """The device modes walk what lowers to a token automaton (a GBNF grammar does not; outlines-core's JSON regex
    leaves a bound on a number out, and the device lowers only an integer's); the host mode masks what fits the
    record."""
    info = SimpleNamespace(drive=drive, max_grammar_bytes=limit, model="m")
    state = SimpleNamespace(info=info, metrics=Metrics("m", drive, "shm"), grammars=None)
    with pytest.raises(APIError) as e:
        asyncio.run(check_grammar(state, spec, "structured_outputs"))
    assert e.value.status == 400 and words in e.value.message and e.value.param == "structured_outputs"
    kind = {GrammarKind.EBNF: "grammar", GrammarKind.REGEX: "regex", GrammarKind.JSON_SCHEMA: "json_schema"}[spec.kind]
    counted = state.metrics.registry.get_sample_value("blink:structured_output_requests_total",
                                                      {"model_name": "m", "kind": kind, "outcome": "refused"})
    assert counted == 1


def test_every_transport_carries_the_grammar_unchanged(tmp_path, monkeypatch):
    """shm is the table itself; rdma pushes the record's bytes from a replica (here over a mapped file, as CI runs
    it); the zmq relay sends the request as JSON and publishes it again in the engine's process."""
    import uuid

    from blink.shared import relay_protocol, slot_table
    from blink.shared.remote_memory import MappedMemory
    from blink.shared.replica_table import ReplicaTable
    from blink.shared.slot_table import SlotTable

    monkeypatch.setattr(slot_table, "SHM_DIR", tmp_path)
    table = SlotTable.create(f"grammar-{uuid.uuid4().hex[:8]}", Geometry(2, 16, 4, max_grammar_bytes=256))
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"ü": {"enum": ["a", "b"]}}})
    request = Request(prompt=[3, 4, 5], max_tokens=2, grammar_kind=int(spec.kind), grammar=spec.text)
    try:
        replica = ReplicaTable(MappedMemory(table.path), table.geometry)
        replica.publish(0, request)  # rdma
        table.publish(1, relay_protocol.request_from_wire(relay_protocol.decode(relay_protocol.encode(
            {"request": relay_protocol.request_to_wire(request)}))["request"]))  # zmq, then the relay's publish
        assert grammar_of(table.slots[0]) == grammar_of(table.slots[1]) == spec
        replica.close()
    finally:
        table.unlink()
