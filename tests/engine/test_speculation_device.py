"""Speculative decoding in the device step (the `graph` and `persistent` modes' work: engine/drive/device_step.py), run
eagerly on the CPU with its kernels in Triton's interpreter: drafts planned, laid out by the layout kernel, settled
and published a run of tokens a slot per step, against the same device step without drafts. Greedy tokens, logprobs
and finishes identical for a batch of speculating and plain rows at several K, stop ids and max_tokens falling inside
an accepted run, the window's room respected, no page left behind."""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest
import torch

from blink.engine.drive.device_step import DeviceStep
from blink.engine.engine import Engine, EngineConfig
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.slot_table import Finish, Geometry, Request, SlotTable
from tests.engine.test_speculation import PROMPTS, _spec

# float32: a run's verification forward rounds as plain decoding's to float32's noise
# (tests/engine/test_speculation.py).
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=8, max_model_len=96,
              dtype="float32")
# Three speculating rows whose prompts repeat (drafts accepted), one of them sampled with a seed (its draws are plain
# decoding's: each row's noise is its position's), and a penalised one, which never drafts.
MIXED = {0: Request(PROMPTS[0], 20, temperature=0.0, ignore_eos=True, logprobs=2),
         1: Request(PROMPTS[1], 20, temperature=0.0, ignore_eos=True),
         2: Request(PROMPTS[0], 16, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
         3: Request(PROMPTS[0], 12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)}


class Served:
    """What each slot was published, step by step (a reader that reads after every step), and how it finished."""

    def __init__(self, slots):
        self.steps: dict[int, list[list[int]]] = {s: [] for s in slots}
        self.logprobs: dict[int, list[float]] = {s: [] for s in slots}
        self.top_ids: dict[int, list[list[int]]] = {s: [] for s in slots}
        self.finish: dict[int, Finish] = dict.fromkeys(slots, Finish.NONE)

    def tokens(self, slot: int) -> list[int]:
        return [t for step in self.steps[slot] for t in step]


def _serve(spec: dict | None, requests: dict[int, Request], window: int = 8, cancel: tuple[int, int] | None = None,
           compiled: bool = False, max_steps: int = 200, prepare=None, timed: bool = True) -> tuple[Served, Engine]:
    """Serves `requests` through a device step over a table of `window`-token windows, reading after every step;
    cancel: (slot, step) to cancel a slot at; compiled: the bookkeeping traced whole (aot_eager: a graph break
    fails); prepare: called with the engine first; timed False: the clock stands still, so the step-cost fit stays
    zero and drafts always pay. Checks every page and draft came back."""
    engine = Engine(EngineConfig(model=str(ensure_tiny_model()), **ENGINE, speculative_config=spec))
    if prepare is not None:
        prepare(engine)
    table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(4, 64, window, page_size=8))
    device = DeviceStep(engine, table)
    if compiled:
        device.step.compile_bookkeeping(backend="aot_eager")
    try:
        for slot, request in requests.items():
            table.publish(slot, request)
        served = Served(requests)
        for step in range(max_steps):
            if cancel is not None and step == cancel[1]:
                table.cancel(cancel[0])
            if timed or step == 0:
                device.clock[0] = time.monotonic()
            device.run(device.bucket_for(int(device.demand[0])))
            for slot in requests:
                out = table.read(slot)
                assert len(out.tokens) <= window
                served.steps[slot].append(out.tokens)
                served.logprobs[slot] += out.logprobs
                served.top_ids[slot] += [ids[:2] for ids in out.top_ids]
                served.finish[slot] = out.finish or served.finish[slot]
            if all(served.finish.values()):
                break
        else:
            raise AssertionError(f"not finished after {max_steps} steps: {served.finish}")
        assert int(engine.pool.num_free) == engine.pool.usable_pages  # every page back, rejected drafts' included
        assert int(engine.state.draft_len.sum()) == 0
        return served, engine
    finally:
        device.close()
        table.unlink()


@pytest.fixture(scope="module")
def plain() -> Served:
    return _serve(None, MIXED)[0]


@pytest.fixture(scope="module", params=[1, 3, 4], ids=lambda k: f"K={k}")
def speculating(request) -> tuple[Served, Engine]:
    """MIXED served with K drafts a run: the layout's and the settle's run widths (K + 1) a power of two and not."""
    return _serve(_spec(request.param), MIXED)


def test_the_device_step_s_greedy_tokens_are_plain_decoding_s_with_drafts_accepted(plain, speculating):
    served, engine = speculating
    assert engine.step.speculation is not None
    for slot in MIXED:
        assert served.tokens(slot) == plain.tokens(slot), slot
        assert served.finish[slot] == plain.finish[slot] == Finish.LENGTH
        assert served.top_ids[slot] == plain.top_ids[slot]
        assert served.logprobs[slot] == pytest.approx(plain.logprobs[slot], abs=1e-4)
    _, draft_tokens, accepted = engine.state.spec_counts.tolist()
    assert accepted > 0 and draft_tokens >= accepted
    # Runs of several tokens were published in one step, and in fewer steps than plain decoding took.
    assert max(len(step) for step in served.steps[0]) > 1
    assert max(len(step) for slot in MIXED for step in served.steps[slot]) <= engine.step.speculation.k + 1
    assert len(served.steps[0]) < len(plain.steps[0])
    assert max(len(step) for step in served.steps[3]) == 1  # the penalised row decoded plainly


def _in_runs(served: Served, slot: int) -> list[tuple[int, bool]]:
    """(index, strictly inside) of each of `slot`'s tokens published in a step with several: a run, drafts accepted."""
    found, done = [], 0
    for step in served.steps[slot]:
        found += [(done + j, j < len(step) - 1) for j in range(len(step))] if len(step) > 1 else []
        done += len(step)
    return found


# K=1's runs (a draft and its bonus token) hold no token's first appearance in the tiny model's text: no stop id
# can end one.
@pytest.mark.parametrize("speculating", [3, 4], indirect=True, ids=lambda k: f"K={k}")
def test_stop_ids_and_max_tokens_inside_an_accepted_run_end_it_there(plain, speculating):
    """max_tokens cutting a run before its last token; a stop id met at the first token of its id that came in a
    run (inside it where the model's repetitive text has one there); every other slot unchanged."""
    served, speculated = speculating
    limit = next(i for i, inside in _in_runs(served, 0) if inside and i > 0) + 1
    stops = [(slot, i, inside) for slot in (0, 1) for i, inside in _in_runs(served, slot)
             if served.tokens(slot)[i] not in served.tokens(slot)[:i]]
    stop_slot, at, _ = max(stops, key=lambda s: s[2])  # inside a run if any is
    stop = served.tokens(stop_slot)[at]
    requests = {0: Request(PROMPTS[0], limit, temperature=0.0, ignore_eos=True, logprobs=2),
                1: Request(PROMPTS[stop_slot], 30, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)),
                2: Request(PROMPTS[1], 20, temperature=0.0, ignore_eos=True)}
    got, engine = _serve(_spec(speculated.step.speculation.k), requests)
    assert got.tokens(0) == plain.tokens(0)[:limit] and got.finish[0] == Finish.LENGTH
    assert got.tokens(1) == served.tokens(stop_slot)[:at + 1] and got.finish[1] == Finish.STOP
    assert got.tokens(2) == plain.tokens(1) and got.finish[2] == Finish.LENGTH
    assert int(engine.state.spec_counts[2]) > 0


def test_a_small_window_caps_the_drafts_and_a_cancel_mid_run_leaks_nothing(plain):
    """A 3-token window: at most 3 tokens a step per slot, the tokens still plain decoding's; slot 1 cancelled
    while it speculates ends aborted (its pages back: _serve checks)."""
    got, engine = _serve(_spec(4), {s: MIXED[s] for s in (0, 1, 2)}, window=3, cancel=(1, 3))
    assert max(len(step) for slot in (0, 2) for step in got.steps[slot]) <= 3
    assert got.tokens(0) == plain.tokens(0) and got.tokens(2) == plain.tokens(2)
    assert got.finish[1] == Finish.ABORT and got.tokens(1) == plain.tokens(1)[:len(got.tokens(1))]
    assert int(engine.state.spec_counts[2]) > 0


def test_the_device_modes_take_speculation_and_say_only_what_the_machine_lacks(small_table):
    """build() no longer refuses drafts: on the CPU the graph mode fails for want of CUDA alone."""
    from blink.engine.drive.modes import build

    engine = Engine(EngineConfig(model=str(ensure_tiny_model()), max_num_seqs=4, max_num_batched_tokens=16,
                                 num_pages=16, page_size=8, max_model_len=64, speculative_config=_spec(2)))
    if torch.cuda.is_available():
        pytest.skip("the CPU's reason")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        build("graph", engine, small_table)


def test_the_compiled_bookkeeping_drafts_and_settles_as_the_eager_one(plain):
    """Plan (drafts included) and commit (the runs' settle) traced whole by torch.compile, as a GPU may run them:
    the same tokens. The clock stands still: compiling the first steps would teach the step-cost fit that drafts
    never pay."""
    got, engine = _serve(_spec(4), MIXED, compiled=True, timed=False)
    assert {s: got.tokens(s) for s in MIXED} == {s: plain.tokens(s) for s in MIXED}
    assert int(engine.state.spec_counts[2]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("drafts", ["ngram", "draft_model"])
@pytest.mark.parametrize("mode", ["graph", "persistent"])
def test_the_device_modes_serve_plain_decoding_s_tokens_with_drafts_accepted(mode, drafts):
    """On a GPU, the captured step (graph replays, or the persistent loop) with drafts, looked up or a draft model's
    (the model itself, its cost taken as none so that it drafts): the host mode's tokens without them, drafts
    accepted, no page left behind."""
    from blink.engine.drive.modes import build, unavailable

    def serve(mode: str, spec: dict | None) -> tuple[dict[int, list[int]], Engine]:
        engine = Engine(EngineConfig(model=str(ensure_tiny_model()), **ENGINE, speculative_config=spec))
        if engine.step.drafter is not None:
            engine.step.speculation = dataclasses.replace(engine.step.speculation, draft_ratio=0.0)
        table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(4, 64, 8, page_size=8))
        try:
            driver = build(mode, engine, table)
            driver.start()
            for slot, request in MIXED.items():
                table.publish(slot, request)
            tokens = {slot: [] for slot in MIXED}
            deadline = time.monotonic() + 60
            while not all(table.slots["state"][: len(MIXED)] == 3) and time.monotonic() < deadline:
                time.sleep(0.001)
                for slot in tokens:
                    tokens[slot] += table.read(slot).tokens
            for slot in tokens:
                tokens[slot] += table.read(slot).tokens
            driver.stop()
            assert driver.failure is None and driver.resident == 0
            driver.close()
            assert int(engine.pool.num_free) == engine.pool.usable_pages
            return tokens, engine
        finally:
            table.unlink()

    why = unavailable(mode, torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    want, _ = serve("host", None)
    got, engine = serve(mode, _spec(4) if drafts == "ngram" else
                        {"model": str(ensure_tiny_model()), "num_speculative_tokens": 3})
    assert got == want
    assert int(engine.state.spec_counts[2]) > 0
