"""Structured outputs in the host mode (blink.engine.core.grammar): the host driver masks a constrained slot's rows
so its answer follows the grammar, leaves the others alone, releases each matcher at the finish, and ends a record
whose grammar cannot be compiled instead of serving it unconstrained (no edge checked what reached the table)."""

from __future__ import annotations

import re
import threading
import time

import pytest

from blink.engine.drive.host import HostDriver
from blink.engine.engine import Engine, EngineConfig
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.grammar import GrammarKind
from blink.shared.slot_table import Finish, Request


def _serve(driver: HostDriver, requests: dict[int, Request],
           seconds: float = 120) -> dict[int, tuple[list[int], Finish]]:
    """Steps until every request finished; bounded by time, not steps (a step with nothing to run takes microseconds,
    a compile's time limit is wall-clock)."""
    table = driver.table
    for slot, request in requests.items():
        table.publish(slot, request)
    got = {slot: ([], Finish.NONE) for slot in requests}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        driver.step()
        for slot in requests:
            out = table.read(slot)
            got[slot] = (got[slot][0] + out.tokens, out.finish or got[slot][1])
        if all(finish for _, finish in got.values()):
            return got
    raise AssertionError(f"not finished after {seconds} s: {got}")


@pytest.fixture
def tiny_llama():
    """Engines on the tiny model, which has an end-of-sequence token (the test checkpoints have none)."""
    return lambda: Engine(EngineConfig(model=str(ensure_tiny_model()), max_num_seqs=4, max_num_batched_tokens=32,
                                       num_pages=64, page_size=8, max_model_len=96))


def test_constrained_slots_follow_their_grammar_beside_unconstrained_ones(tiny_llama, small_table):
    regex = r"[a-c]{3,6}"
    prompt = [5, 6, 7, 8]
    plain = Request(prompt=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = _serve(HostDriver(tiny_llama(), small_table), {1: plain})[1][0]
    small_table.free(1)
    engine = tiny_llama()
    driver = HostDriver(engine, small_table)
    got = _serve(driver, {
        0: Request(prompt=prompt, max_tokens=20, temperature=1.0, seed=3, grammar_kind=int(GrammarKind.REGEX),
                   grammar=regex),
        1: plain,
        2: Request(prompt=prompt, max_tokens=8, grammar_kind=int(GrammarKind.REGEX), grammar="(ab"),
    })
    tokens, finish = got[0]
    assert finish == Finish.STOP
    assert re.fullmatch(regex, engine.tokenizer.decode(tokens)), engine.tokenizer.decode(tokens)
    assert got[1] == (alone, Finish.LENGTH)  # the unconstrained row as it is alone
    assert got[2] == ([], Finish.ABORT)  # never admitted with a grammar it cannot mask
    assert driver.rank.grammars.matchers == {}
    assert driver.rank.grammars.ended == {"failed": 1, "timeout": 0}  # what /metrics reports


def test_a_grammar_waits_for_the_end_of_the_reasoning(tiny_llama, small_table):
    """A record with a reasoning_end_id goes unmasked, token for token as without a grammar, up to and with that
    token; its grammar masks from the next one (the random model plays a thinking one: the end token is the third it
    draws alone)."""
    regex, prompt = r"[a-c]{3,6}", [5, 6, 7, 8]
    alone = _serve(HostDriver(tiny_llama(), small_table),
                   {0: Request(prompt=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)})[0][0]
    small_table.free(0)
    end = alone[2]
    assert end not in alone[:2]
    engine = tiny_llama()
    driver = HostDriver(engine, small_table)
    tokens, finish = _serve(driver, {0: Request(prompt=prompt, max_tokens=30, temperature=0.0, reasoning_end_id=end,
                                                grammar_kind=int(GrammarKind.REGEX), grammar=regex)})[0]
    assert tokens[:3] == alone[:3]
    assert finish == Finish.STOP
    assert re.fullmatch(regex, engine.tokenizer.decode(tokens[3:])), engine.tokenizer.decode(tokens)
    assert driver.rank.grammars.waiting == {} and driver.rank.grammars.matchers == {}


def test_a_model_without_an_end_token_ends_constrained_records_and_serves_the_rest(tiny_engine, small_table):
    driver = HostDriver(tiny_engine(), small_table)  # the test checkpoints have no eos
    got = _serve(driver, {0: Request(prompt=[5, 6], max_tokens=4, grammar_kind=int(GrammarKind.REGEX), grammar="a+"),
                          1: Request(prompt=[5, 6], max_tokens=4, temperature=0.0)})
    assert got[0] == ([], Finish.ABORT)
    assert len(got[1][0]) == 4 and got[1][1] == Finish.LENGTH


def test_the_offline_api_takes_vllm_s_structured_outputs():
    from blink.engine import LLM, SamplingParams
    from blink.shared.grammar import StructuredOutputs

    llm = LLM(str(ensure_tiny_model()), max_num_seqs=4, max_model_len=96)
    try:
        # Compiled before anything is queued; the library's words follow (llguidance's "Invalid type", xgrammar's
        # "Unsupported type").
        with pytest.raises(ValueError, match=r"invalid JSON schema: (Invalid|Unsupported) type"):
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(json={"type": "colour"})))
        params = [SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                                 structured_outputs=StructuredOutputs(choice=["north", "south west"]))
                  for s in range(3)] + [SamplingParams(max_tokens=30, temperature=0.0,
                                                        structured_outputs=StructuredOutputs(regex=r"\d{2}-\d{2}"))]
        outs = llm.generate(["Which way?"] * 4, params)
        assert [o.finish_reason for o in outs] == ["stop"] * 4
        assert all(o.text in ("north", "south west") for o in outs[:3])
        assert re.fullmatch(r"\d{2}-\d{2}", outs[3].text)
    finally:
        llm.close()
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(regex="a"))


def test_a_record_whose_grammar_outlasts_the_time_limit_is_ended_not_waited_on(tiny_llama, small_table):
    from blink.shared.grammar import GrammarCompiler

    driver = HostDriver(tiny_llama(), small_table)
    grammars = driver.rank.grammars
    never = threading.Event()

    class Stuck:  # a compile that never ends, as xgrammar's can on a schema the ingress did not see
        def compile(self, spec):
            never.wait(30)

        def matcher(self, compiled):
            return compiled

    grammars._compiler = GrammarCompiler(Stuck(), timeout_s=0.2)
    try:
        got = _serve(driver, {0: Request(prompt=[5, 6], max_tokens=4, grammar_kind=int(GrammarKind.REGEX),
                                         grammar="a+"),
                              1: Request(prompt=[5, 6], max_tokens=4, temperature=0.0, ignore_eos=True)})
        assert got[0] == ([], Finish.ABORT)
        assert got[1][1] == Finish.LENGTH  # served meanwhile
        assert grammars.ended == {"failed": 0, "timeout": 1}
    finally:
        never.set()
        grammars._compiler.close()
