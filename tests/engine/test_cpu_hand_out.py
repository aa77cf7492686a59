"""The CPU's C++ head and hand-out (blink.engine.kernels.cpu_hand_out, cpu_hand_out.cpp) against their torch references
(scheduler._head, _hand_out) where the shared tests (tests/engine/test_hand_out_kernel.py) do not reach: hundreds of
slots, NaN keys, the inputs the C++ refuses; and in a whole engine on the tiny model whose pool runs short (requests
rotate out and back, new ones held back behind them), every call of its plans checked against the references on a
copy of the state it met, and the text that of the reference's engine."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core.bookkeeping import TORCH_BOOKKEEPING, Bookkeeping
from blink.engine.core.policy import POLICIES, StepCost, policy_named
from blink.engine.core.scheduler import PlanKernels, _hand_out, _head
from blink.engine.core.state import Slots
from blink.engine.kernels import cpu, cpu_hand_out
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.service_class import ServiceClass
from tests.engine.test_hand_out_kernel import COSTS, _head_state, _mirror, _state
from tests.support.cpu_kernels import cpu_kernels_or_skip

HEAD = ("running", "resident", "precedence", "live", "starting")
HAND_OUT = ("take", "entries", "order", "cap")


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_kernels_or_skip()


def _same(fields: tuple[str, ...], want, have, *where) -> None:
    for field, w, h in zip(fields, want, have, strict=True):
        if w is None:
            assert h is None, (*where, field)
            continue
        assert h.dtype == w.dtype and h.shape == w.shape and torch.equal(h, w), (*where, field, h, w)


def _check_head(state: Slots, policy, mirror, *where) -> None:
    want_state, have_state = copy.deepcopy(state), copy.deepcopy(state)
    _same(HEAD, _head(want_state, policy, mirror), cpu_hand_out.head(have_state, policy, mirror), *where)
    for field in ("status", "spec_rate"):
        assert torch.equal(getattr(have_state, field), getattr(want_state, field)), (*where, field)


@pytest.mark.parametrize("name", POLICIES)
def test_hundreds_of_slots_as_the_reference(name):
    """More slots than the shared tests' Triton interpreter affords: the orders' ties over hundreds of slots."""
    rng = random.Random(20 + POLICIES.index(name))
    policy = policy_named(name)
    cost = StepCost(torch.device("cpu"))
    for S, budget in ((300, 512), (1024, 8192)):
        for trial in range(3):
            state, live = _state(rng, S)
            cost.fit.copy_(torch.tensor(COSTS[trial % len(COSTS)], dtype=torch.float64))
            for prompt_rows in (0, 37, 8192):
                want = _hand_out(state, policy, cost, budget, prompt_rows, live)
                have = cpu_hand_out.hand_out(state, policy, cost, budget, prompt_rows, live)
                _same(HAND_OUT, want, have, name, S, trial, prompt_rows)
            state = _head_state(rng, S)
            for mirror in (None, _mirror(10, 4), _mirror(3, 4)):
                _check_head(state, policy, mirror, name, S, trial, mirror)


def test_nan_deadlines_and_slos_as_torch_sorts_and_reduces_them():
    """torch's sort puts NaN last (equal to each other, so they keep the slots' order) and its amin returns NaN, which
    the TPOT cap sends to the whole budget; the C++ answers alike."""
    rng = random.Random(7)
    policy = policy_named("slo")
    cost = StepCost(torch.device("cpu"))
    cost.fit.copy_(torch.tensor([0.01, 0.0001], dtype=torch.float64))
    for trial in range(6):
        state, live = _state(rng, 40)
        nan = torch.tensor([rng.random() < 0.3 for _ in range(40)])
        state.ttft_deadline.masked_fill_(nan, float("nan"))
        state.tpot_slo.masked_fill_(nan if trial % 2 else torch.zeros_like(nan), float("nan"))
        for prompt_rows in (0, 5):
            _same(HAND_OUT, _hand_out(state, policy, cost, 256, prompt_rows, live),
                  cpu_hand_out.hand_out(state, policy, cost, 256, prompt_rows, live), trial, prompt_rows)
        _check_head(state, policy, _mirror(10, 4), trial)


def test_the_kernels_refuse_state_they_cannot_read():
    """A state tensor of another dtype than Slots' (or not contiguous), or an unknown policy, is a clear error, not
    a misread."""
    state, live = _state(random.Random(0), 8)
    policy, cost = policy_named("slo"), StepCost(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="live must be Bool"):
        cpu_hand_out.hand_out(state, policy, cost, 64, 0, live.long())
    state.arrival = state.arrival.int()
    with pytest.raises(RuntimeError, match="arrival must be Long"):
        cpu_hand_out.head(state, policy, None)
    state.arrival = torch.zeros(16, dtype=torch.int64)[::2]
    with pytest.raises(RuntimeError, match="arrival must be a contiguous"):
        cpu_hand_out.hand_out(state, policy, cost, 64, 0, live)
    state.arrival = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="unknown policy"):
        cpu.ops().plan_hand_out(live, state.seq_len, state.num_computed, state.prompt_logprobs, state.scored,
                                state.prompt_len, state.room, state.service_class, state.priority, state.ttft_deadline,
                                state.arrival, state.tpot_slo, cost.values, 64, 64, 0, len(POLICIES), 0, 16)


class Checked:
    """cpu_hand_out's head and hand-out as an engine binds them, each call held to its reference on a copy of the
    state it met."""

    def __init__(self):
        self.heads = self.hand_outs = self.held_back = self.scoring = 0

    def head(self, state, policy, mirror):
        reference = copy.deepcopy(state)
        want = _head(reference, policy, mirror)
        have = cpu_hand_out.head(state, policy, mirror)
        _same(HEAD, want, have, "head", self.heads)
        for field in ("status", "spec_rate"):
            assert torch.equal(getattr(state, field), getattr(reference, field)), ("head", self.heads, field)
        self.heads += 1
        self.held_back += int((have[1] & ~state.paused & ~state.cancel & ~have[3]).sum())
        return have

    def hand_out(self, state, policy, cost, token_budget, prompt_rows, live):
        want = _hand_out(state, policy, cost, token_budget, prompt_rows, live)
        have = cpu_hand_out.hand_out(state, policy, cost, token_budget, prompt_rows, live)
        _same(HAND_OUT, want, have, "hand_out", self.hand_outs, prompt_rows)
        self.hand_outs += 1
        self.scoring += bool(prompt_rows)
        return have


PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11], list(range(3, 40)),
           [*range(40, 3, -1), 7, 8], [9] * 21]
# Five requests, four slots, a 24-token budget and a pool of 12 pages of 8 tokens: chunked prefills under the cap,
# requests rotated out to the host mirror and new ones held back behind them. float32, as test_speculation's engine.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=24, page_size=8, max_model_len=96, num_pages=13, dtype="float32")


@pytest.mark.parametrize("name", POLICIES)
def test_an_engine_planning_in_cpp_generates_the_reference_s_tokens(name):
    """Greedy and seeded sampling, requests of different lengths, priorities and classes, one ended early by a stop
    id and others by max_tokens, some asking for their prompt's logprobs: the same tokens, finishes and prompt
    logprobs as the engine whose plans the torch references start and hand out."""
    reference = LLM(str(ensure_tiny_model()), **ENGINE, scheduling_policy=name)
    reference.engine.step.use(TORCH_BOOKKEEPING)
    llm = LLM(str(ensure_tiny_model()), **ENGINE, scheduling_policy=name)
    checked = Checked()
    llm.engine.step.use(Bookkeeping(plan=PlanKernels(head=checked.head, hand_out=checked.hand_out)))
    greedy = [o.token_ids for o in reference.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24))]
    stop = greedy[0][5]
    lengths = (40, 7, 50, 30, 45)
    for params in ([SamplingParams(temperature=0, max_tokens=n, priority=i % 3, service_class=ServiceClass(i % 2))
                    for i, n in enumerate(lengths)],
                   [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])] * len(PROMPTS),
                   [SamplingParams(temperature=0.7, top_k=8, max_tokens=n, seed=i, prompt_logprobs=1 if i % 2 else None)
                    for i, n in enumerate(lengths)]):
        want, got = reference.generate(PROMPTS, params), llm.generate(PROMPTS, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in want]
    assert checked.heads > 0 and checked.hand_outs > 0 and checked.scoring > 0
    assert int(llm.engine.state.num_preemptions) > 0  # the pool ran short: requests rotated out
    assert checked.held_back > 0  # and new ones waited behind them
