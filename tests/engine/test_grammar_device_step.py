"""Structured outputs in the device step (the graph and persistent modes' work, run eagerly on the CPU with its kernels
in Triton's interpreter; the grammar gate polled by the test between steps, as its thread does): regex, choice and
JSON-schema requests follow their grammar beside an unconstrained row whose tokens are those it has alone; a grammar
that does not lower and one larger than the arena end their records, and the engine serves the rest."""

from __future__ import annotations

import json
import re
import time
import uuid
from types import SimpleNamespace

import jsonschema
import pytest

from blink.engine.drive import device_grammars
from blink.engine.drive.device_step import DeviceStep
from blink.engine.engine import Engine, EngineConfig
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.grammar import ANY_OBJECT, GrammarKind, GrammarSpec
from blink.shared.slot_table import Finish, Geometry, Request, SlotTable
from tests.support.grammar_requests import CHOICES, PLAIN, REGEX, constrained, serve

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 20},
                                           "name": {"type": "string", "maxLength": 4}},
          "required": ["kind", "age"]}


@pytest.fixture
def table():
    table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(4, 64, 3, page_size=8,
                                                                         max_grammar_bytes=1024))
    yield table
    table.unlink()


@pytest.fixture
def device(table):
    """A device step on the tiny model (it has an end-of-sequence token), with a 1 MiB arena; closed afterwards."""
    opened = []

    def make() -> DeviceStep:
        engine = Engine(EngineConfig(model=str(ensure_tiny_model()), max_num_seqs=4, max_num_batched_tokens=32,
                                     num_pages=64, page_size=8, max_model_len=96, enable_prefix_caching=False,
                                     grammar_arena_bytes=1 << 20))
        opened.append(DeviceStep(engine, table))
        return opened[-1]

    yield make
    for step in opened:
        step.close()


def _serve(table: SlotTable, device: DeviceStep, requests: dict[int, Request], seconds: float = 600,
           publish: bool = True) -> dict:
    """Serves `requests`, polling the gate and stepping the device between reads, as the modes' threads do."""
    def step() -> None:
        device.grammars.poll()
        device.clock[0] = time.monotonic()
        device.run(device.bucket_for(int(device.demand[0])))

    return serve(table, requests, step, seconds, publish)


def test_constrained_rows_follow_their_grammar_beside_an_unchanged_one(table, device):
    step = device()
    alone = _serve(table, step, {1: PLAIN})[1]
    got = _serve(table, step, {
        0: constrained(GrammarSpec(GrammarKind.REGEX, REGEX), temperature=1.0, seed=3),
        1: PLAIN,
        2: constrained(GrammarSpec.choice(CHOICES), temperature=0.0),
        3: constrained(GrammarSpec.json_schema(SCHEMA), temperature=1.0, seed=11),
    })
    decode = step.engine.tokenizer.decode
    assert got[1] == alone  # the unconstrained row's greedy tokens, as without its neighbours
    assert all(got[s][1] == Finish.STOP for s in (0, 2, 3)), got
    assert re.fullmatch(REGEX, decode(got[0][0])), decode(got[0][0])
    assert decode(got[2][0]) in CHOICES
    jsonschema.validate(json.loads(decode(got[3][0])), SCHEMA)
    assert (step.grammars.state == -1).all()  # each finished slot let go of its state
    step.grammars.poll()
    assert step.grammars.blocks == {} and step.grammars.space.free_words == step.grammars.space.words


def test_a_grammar_waits_for_the_end_of_the_reasoning(table, device):
    """A record with a reasoning_end_id walks unmasked, token for token as without a grammar, up to and with that
    token, then follows its grammar (the random model plays a thinking one: the end token is its third alone)."""
    step = device()
    alone = _serve(table, step, {0: Request(prompt=PLAIN.prompt, max_tokens=8, temperature=0.0, ignore_eos=True)})
    tokens_alone = alone[0][0]
    end = tokens_alone[2]
    assert end not in tokens_alone[:2]
    got = _serve(table, step, {0: constrained(GrammarSpec(GrammarKind.REGEX, REGEX), temperature=0.0,
                                              reasoning_end_id=end), 1: PLAIN})
    tokens, finish = got[0]
    assert tokens[:3] == tokens_alone[:3] and finish == Finish.STOP
    assert re.fullmatch(REGEX, step.engine.tokenizer.decode(tokens[3:])), step.engine.tokenizer.decode(tokens)
    assert got[1][1] == Finish.LENGTH
    assert (step.grammars.state == -1).all()


def test_the_gate_wakes_when_a_lowering_completes(table, device, monkeypatch):
    """The gate's thread polls every POLL_S when nothing wakes it; a lowering that completes wakes it at once, so a
    record is readied long before the next poll would come (here 60 s), and stop() does not wait for one."""
    monkeypatch.setattr(device_grammars, "POLL_S", 60.0)
    step = device()
    table.publish(0, constrained(GrammarSpec(GrammarKind.REGEX, "ab+c")))
    started = time.monotonic()
    step.grammars.start()  # its first poll submits the record's lowering, then waits
    try:
        while step.grammars.ready[0] != device_grammars.READY and time.monotonic() - started < 30:
            time.sleep(0.01)
        assert step.grammars.ready[0] == device_grammars.READY
    finally:
        step.grammars.stop()
    assert time.monotonic() - started < 30


def test_requests_of_one_spec_share_its_block(table, device):
    step, spec = device(), GrammarSpec.json_schema(SCHEMA)
    requests = {0: constrained(spec, temperature=0.0), 2: constrained(spec, temperature=1.0, seed=7)}
    for slot, request in requests.items():
        table.publish(slot, request)
    deadline = time.monotonic() + 300
    while len(step.grammars.held) < 2 and time.monotonic() < deadline:
        step.grammars.poll()
        time.sleep(0.01)
    _, size, holders = step.grammars.blocks[spec]
    assert list(step.grammars.blocks) == [spec] and holders == {0, 2}
    assert step.grammars.space.free_words == step.grammars.space.words - size  # one copy in the arena
    got = _serve(table, step, requests, publish=False)
    for tokens, finish in got.values():
        assert finish == Finish.STOP
        jsonschema.validate(json.loads(step.engine.tokenizer.decode(tokens)), SCHEMA)
    step.grammars.poll()
    assert step.grammars.blocks == {} and step.grammars.held == {}
    assert step.grammars.space.free_words == step.grammars.space.words


def test_more_schemas_parse_greedy_and_seeded(table, device):
    schemas = [
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green"]},
                                                   "minItems": 1, "maxItems": 2}}, "required": ["tags"]},
        {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                           {"type": "boolean"}]},
                                          "day": {"type": "string", "format": "date"}}, "required": ["id", "day"]},
    ]
    step = device()
    requests = {2 * i + seeded: constrained(GrammarSpec.json_schema(schema), temperature=1.0 if seeded else 0.0,
                                             seed=5)
                for i, schema in enumerate(schemas) for seeded in (0, 1)}
    got = _serve(table, step, requests)
    for slot, (tokens, finish) in got.items():
        assert finish == Finish.STOP, (slot, got)
        jsonschema.validate(json.loads(step.engine.tokenizer.decode(tokens)), schemas[slot // 2])


def test_grammars_that_cannot_be_walked_end_their_records_and_the_rest_is_served(table, device):
    step = device()
    step.grammars.space = device_grammars.Arena(400)  # smaller than the schema's table, larger than the regex's
    got = _serve(table, step, {
        0: constrained(GrammarSpec(GrammarKind.EBNF, 'root ::= "a" root | "b"')),  # not regular
        1: PLAIN,
        2: constrained(GrammarSpec.json_schema(SCHEMA), temperature=0.0),  # too large for the arena
        3: constrained(GrammarSpec(GrammarKind.REGEX, "ab+c"), temperature=0.0),
    })
    assert got[0] == ([], Finish.ABORT) and got[2] == ([], Finish.ABORT)
    assert len(got[1][0]) == 8 and got[1][1] == Finish.LENGTH
    assert got[3][1] == Finish.STOP and re.fullmatch("ab+c", step.engine.tokenizer.decode(got[3][0]))
    assert step.grammars.ended == {"failed": 2, "timeout": 0}


def test_a_readied_record_that_leaves_unadmitted_leaves_its_slot_no_grammar(table, device):
    """A record the gate readied but the device never admitted (ended here by the host, as the device ends a record
    it drops) clears its slot's ready word as its block leaves: the slot's next request, unconstrained, is not landed
    with the freed block, and draws the tokens it draws in a slot that never held a grammar."""
    step = device()
    alone = _serve(table, step, {1: PLAIN})[1]
    table.publish(0, constrained(GrammarSpec(GrammarKind.REGEX, REGEX)))
    deadline = time.monotonic() + 60
    while step.grammars.poll() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert int(step.grammars.ready[0]) == device_grammars.READY
    table.admit(0)
    table.finish(0, Finish.ABORT)
    table.free(0)
    step.grammars.poll()
    assert int(step.grammars.ready[0]) == 0 and step.grammars.held == {} and step.grammars.blocks == {}
    assert _serve(table, step, {0: PLAIN})[0] == alone


def test_a_record_waiting_at_the_gate_gives_the_graph_driver_no_step(table, device):
    """The graph mode's host thread backs off while the only record waits for its grammar's table, and steps once
    the gate readied it."""
    from blink.engine.drive.device_step import DeviceDriver

    driver = DeviceDriver()
    driver.step, driver.table = device(), table
    table.publish(0, constrained(GrammarSpec(GrammarKind.REGEX, REGEX)))
    assert driver.idle()
    deadline = time.monotonic() + 60
    while driver.step.grammars.poll() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not driver.idle()


def test_the_gate_starts_lowering_json_object_when_it_starts(table, device):
    step = device()
    step.grammars.start()
    try:  # the cache's future: a json_object request finds it lowered or lowering
        assert GrammarSpec.json_schema(ANY_OBJECT) in step.grammars.compiler._pinned
    finally:
        step.grammars.stop()


class _Counted:
    """A lowering that counts its compiles by spec (json_object's real one takes 12 s, past the compile limit)."""

    def __init__(self):
        self.calls: dict[GrammarSpec, int] = {}

    def compile(self, spec: GrammarSpec) -> str:
        self.calls[spec] = self.calls.get(spec, 0) + 1
        return f"table of {spec.text}"


def test_json_object_s_table_stays_cached_past_the_cache_s_limit(table):
    """The start-up lowering of json_object is pinned: CACHED_TABLES + 8 other specs later, a json_object request
    is served from the cache, not lowered again (which would outlast the compile limit and be refused)."""
    import torch

    from blink.shared.grammar import GrammarCompiler

    engine = SimpleNamespace(device=torch.device("cpu"), state=SimpleNamespace(num_slots=4),
                             tokenizer=SimpleNamespace(raw=None), model_config=SimpleNamespace(vocab_size=64),
                             generation=SimpleNamespace(eos_token_ids=[1]))
    grammars = device_grammars.DeviceGrammars(engine, table, arena_bytes=1024)
    backend = _Counted()
    grammars._compiler = GrammarCompiler(backend, cached=device_grammars.CACHED_TABLES)
    json_object = GrammarSpec.json_schema(ANY_OBJECT)
    grammars.start()
    try:
        first = grammars.compiler.submit(json_object)
        for i in range(device_grammars.CACHED_TABLES + 8):  # other specs, each used once after it
            grammars.compiler.submit(GrammarSpec(GrammarKind.REGEX, f"a{{{i}}}")).result(10)
        again = grammars.compiler.submit(json_object)
        assert again is first and again.result(10) == f"table of {json_object.text}"
        assert backend.calls[json_object] == 1
        # the others are still bounded: the oldest was evicted and lowers again
        grammars.compiler.submit(GrammarSpec(GrammarKind.REGEX, "a{0}")).result(10)
        assert backend.calls[GrammarSpec(GrammarKind.REGEX, "a{0}")] == 2
    finally:
        grammars.close()
