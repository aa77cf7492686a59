"""/metrics counts how each structured-output request went (blink.ingress.structured, blink.ingress.metrics): served
on the host or walked on the device, refused at the ingress by reason (unsupported in this drive mode, too large,
invalid, a compile past the time limit), and ended by the engine (the totals its status reports); the device modes'
grammar arena, its bytes in use and resident tables."""

from __future__ import annotations

import asyncio
import re
import threading
from types import SimpleNamespace

import pytest

from blink.engine.model.tiny_model import ensure_tiny_model
from blink.ingress.errors import APIError
from blink.ingress.metrics import Metrics
from blink.ingress.protocol import CompletionRequest
from blink.ingress.structured import check_grammar, grammar_of_body
from blink.shared.control import EngineStatus
from blink.shared.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from blink.shared.tokenizer import Tokenizer


async def _off_loop(f, *args):
    return f(*args)


@pytest.fixture
def state():
    tokenizer = Tokenizer(ensure_tiny_model())

    def make(drive: str) -> SimpleNamespace:
        info = SimpleNamespace(drive=drive, max_grammar_bytes=256, model="m", vocab_size=1174, eos_token_ids=[1])
        return SimpleNamespace(info=info, metrics=Metrics("m", drive, "shm"), grammars=None, grammar_timeout_s=10.0,
                               tokenizer=tokenizer, off_loop=_off_loop)
    return make


def _count(metrics: Metrics, name: str, **labels: str) -> float:
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "model_name": "m"}.items()))
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(wanted)}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _refused(state, spec: GrammarSpec, param: str = "guided_regex") -> APIError:
    with pytest.raises(APIError) as e:
        asyncio.run(check_grammar(state, spec, param))
    assert e.value.status == 400
    return e.value


def test_refusals_are_counted_by_reason(state):
    host, graph = state("host"), state("graph")
    asyncio.run(check_grammar(host, GrammarSpec(GrammarKind.REGEX, "a+"), "guided_regex"))
    asyncio.run(check_grammar(graph, GrammarSpec(GrammarKind.REGEX, "a+"), "guided_regex"))
    assert "invalid regex" in _refused(host, GrammarSpec(GrammarKind.REGEX, "(ab")).message
    assert "--max-grammar-bytes" in _refused(host, GrammarSpec(GrammarKind.REGEX, "a" * 300)).message
    # Served by the host mode's matcher; not a token automaton, so the device modes refuse it.
    grammar = GrammarSpec(GrammarKind.EBNF, 'root ::= "a" root | "b"')
    asyncio.run(check_grammar(host, grammar, "guided_grammar"))
    assert "not walked on the device" in _refused(graph, grammar, "guided_grammar").message

    def regex(outcome=None, reason=None, metrics=host.metrics, kind="regex"):
        if reason is not None:
            return _count(metrics, "blink:structured_output_refused_requests_total", kind=kind, reason=reason)
        return _count(metrics, "blink:structured_output_requests_total", kind=kind, outcome=outcome)

    assert (regex("host"), regex("device"), regex("refused")) == (1, 0, 2)
    assert (regex(reason="invalid"), regex(reason="too_large"), regex(reason="unsupported")) == (1, 1, 0)
    assert regex("device", metrics=graph.metrics) == 1
    assert regex("host", kind="grammar") == 1
    assert regex(reason="unsupported", metrics=graph.metrics, kind="grammar") == 1


def test_a_compile_past_the_time_limit_is_counted_as_a_timeout(state):
    host = state("host")
    never = threading.Event()

    class Stuck:  # a compile that never ends, as xgrammar's can on a nested schema
        def compile(self, spec):
            never.wait(30)

    host.grammars = GrammarCompiler(Stuck(), timeout_s=0.2)
    try:
        assert "did not compile within 0.2 s" in _refused(host, GrammarSpec(GrammarKind.REGEX, "a+")).message
    finally:
        never.set()
        host.grammars.close()
    assert _count(host.metrics, "blink:structured_output_refused_requests_total", kind="regex",
                  reason="timeout") == 1


def test_a_malformed_request_is_counted_invalid_by_the_field_that_asked(state):
    host = state("host")
    body = CompletionRequest(model="m", prompt="x", guided_regex="a", guided_choice=["b"])
    with pytest.raises(APIError, match="one structured output at a time"):
        asyncio.run(grammar_of_body(host, body))
    assert _count(host.metrics, "blink:structured_output_refused_requests_total", kind="regex",
                  reason="invalid") == 1


def test_what_the_engine_ended_is_rendered_from_its_status():
    metrics = Metrics("m", "graph", "shm")
    client = SimpleNamespace(running=0, waiting=0, failed_over=0, health=lambda: SimpleNamespace(failovers=0))
    status = EngineStatus(state="ready", epoch=1, steps=0, running=0, kv_pages_used=0, kv_pages_total=1,
                          preemptions=0, structured_output_ended={"failed": 2, "timeout": 1})
    text = metrics.render(client, status, degraded=False).decode()
    assert 'blink:structured_output_engine_ended_requests_total{model_name="m",reason="failed"} 2.0' in text
    assert 'blink:structured_output_engine_ended_requests_total{model_name="m",reason="timeout"} 1.0' in text


def test_the_device_grammar_arena_is_rendered_only_where_the_engine_has_one():
    """Graph and persistent report their arena's bytes in use, its size and its resident tables; the host mode's
    status carries none (0), so no series appears, as the speculation figures of an engine that does not draft."""
    client = SimpleNamespace(running=0, waiting=0, failed_over=0, health=lambda: SimpleNamespace(failovers=0))
    names = ("blink:grammar_arena_used_bytes", "blink:grammar_arena_capacity_bytes",
             "blink:num_grammar_tables_resident")
    device = EngineStatus(state="ready", epoch=1, steps=0, running=0, kv_pages_used=0, kv_pages_total=1,
                          preemptions=0, grammar_arena_bytes_used=3 << 20, grammar_arena_bytes_total=64 << 20,
                          grammar_tables_resident=2)
    metrics = Metrics("m", "graph", "shm")
    metrics.render(client, device, degraded=False)
    got = [metrics.registry.get_sample_value(name, {"model_name": "m"}) for name in names]
    assert got == [3 << 20, 64 << 20, 2]
    host = EngineStatus(state="ready", epoch=1, steps=0, running=0, kv_pages_used=0, kv_pages_total=1, preemptions=0)
    metrics = Metrics("m", "host", "shm")
    text = metrics.render(client, host, degraded=False).decode()
    assert not any(f"{name}{{" in text for name in names), text


def test_the_engine_reports_its_grammar_arena_as_blocks_come_and_go():
    """What the engine's status reads (DeviceGrammars.arena_usage): the arena's used words follow the blocks taken
    and given back, and nothing is reported while the slot table carries no grammar."""
    from blink.engine.drive.device_grammars import Arena, DeviceGrammars
    from blink.services.engine_service import _grammar_arena

    grammars = DeviceGrammars.__new__(DeviceGrammars)  # its gate's bookkeeping only: no engine, no device memory
    grammars.table = SimpleNamespace(geometry=SimpleNamespace(max_grammar_bytes=1024))
    grammars.space, grammars.blocks = Arena(100), {}
    engine = SimpleNamespace(step=SimpleNamespace(grammar=grammars))
    assert _grammar_arena(engine) == {"grammar_arena_bytes_used": 0, "grammar_arena_bytes_total": 400,
                                      "grammar_tables_resident": 0}
    a, b = grammars.space.take(30), grammars.space.take(20)
    grammars.blocks.update({"a": (a, 30, {0}), "b": (b, 20, {1})})
    assert _grammar_arena(engine)["grammar_arena_bytes_used"] == 200
    grammars.space.give(a, 30)
    del grammars.blocks["a"]
    assert _grammar_arena(engine) == {"grammar_arena_bytes_used": 80, "grammar_arena_bytes_total": 400,
                                      "grammar_tables_resident": 1}
    assert grammars.space.used == grammars.space.words - grammars.space.free_words
    grammars.table = SimpleNamespace(geometry=SimpleNamespace(max_grammar_bytes=0))
    assert _grammar_arena(engine) == {}
    assert _grammar_arena(SimpleNamespace(step=SimpleNamespace(grammar=None))) == {}  # the host mode's: no arena
