"""The plan's hand-out kernel (blink.engine.kernels.hand_out, in Triton's interpreter) hands out the token budget as
the torch reference (blink.engine.core.scheduler._hand_out) does, field by field (tokens, prompt logprobs, the
order, the cap), for every policy: random states with ties in arrival, priority and deadline, latency-sensitive and
best-effort mixes, TPOT caps that bind and that do not, prompt logprobs cut by the step's rows and by the window,
slot counts that are and are not a power of two, and more slots than one block of compares. The CPU's C++ twins
(blink.engine.kernels.cpu_hand_out) are held to the same references on the same states."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernel

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from blink.engine.core.policy import POLICIES, StepCost, policy_named
from blink.engine.core.rotation import HostMirror
from blink.engine.core.scheduler import _hand_out, _head
from blink.engine.core.state import Slots, SlotStatus
from blink.engine.kernels import cpu_hand_out
from blink.engine.kernels import hand_out as triton_hand_out
from blink.engine.kernels.hand_out import COMPARE_BLOCK
from tests.support.cpu_kernels import cpu_kernels_or_skip


@pytest.fixture(params=["triton", "cpu"])
def kernels(request):
    """The module whose `head` and `hand_out` stand in for the references: the device step's Triton kernels, or the
    CPU's C++ ones."""
    if request.param == "cpu":
        cpu_kernels_or_skip()
        return cpu_hand_out
    return triton_hand_out


def _state(rng: random.Random, S: int) -> tuple[Slots, torch.Tensor]:
    """A random state and its live mask: decodes, prefills, idle slots; few distinct keys, so that ties abound."""
    state = Slots(S, 4096, 8, 16, torch.device("cpu"))

    def ints(*choices: int) -> torch.Tensor:
        return torch.tensor([rng.choice(choices) for _ in range(S)])

    state.num_computed.copy_(ints(0, 0, 5, 40, 300))
    state.seq_len.copy_(state.num_computed + ints(0, 1, 1, 1, 2, 7, 64, 500))
    state.prompt_len.copy_(torch.minimum(state.seq_len, state.num_computed + ints(0, 1, 3, 100)).clamp(min=1))
    state.arrival.copy_(ints(0, 1, 1, 2, 3, 1 << 40))
    state.priority.copy_(ints(-(2**15), -1, 0, 0, 3, 2**15 - 1))
    state.service_class.copy_(ints(0, 1, 1))
    state.ttft_deadline.copy_(torch.tensor([rng.choice([float("inf"), 0.5, 0.5, 2.0, -1.0]) for _ in range(S)],
                                           dtype=torch.float64))
    state.tpot_slo.copy_(torch.tensor([rng.choice([float("inf"), 0.05, 0.02, 1.0]) for _ in range(S)],
                                      dtype=torch.float64))
    state.prompt_logprobs.copy_(ints(-1, -1, 0, 2))
    state.scored.copy_((state.num_computed - ints(0, 0, 3)).clamp(min=0))
    state.room.copy_(ints(1, 4, 50, 4097))
    return state, torch.tensor([rng.random() < 0.8 for _ in range(S)])


COSTS = ([0.0, 0.0], [0.01, 0.0001], [0.01, 0.0], [0.03, 0.001], [0.001, 1e-6])  # per step, per token; 0.0: no fit


@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's numpy, for a fit with no per-token cost
@pytest.mark.parametrize("name", POLICIES)
def test_the_kernel_hands_out_the_budget_as_the_reference_does(kernels, name):
    rng = random.Random(POLICIES.index(name))
    policy = policy_named(name)
    cost = StepCost(torch.device("cpu"))
    for S, budget in ((1, 8), (5, 64), (8, 300), (13, 1), (COMPARE_BLOCK + 7, 2048)):
        for trial in range(4):
            state, live = _state(rng, S)
            cost.fit.copy_(torch.tensor(COSTS[trial % len(COSTS)], dtype=torch.float64))
            for prompt_rows in (0, 1, 37):
                want = _hand_out(state, policy, cost, budget, prompt_rows, live)
                have = kernels.hand_out(state, policy, cost, budget, prompt_rows, live)
                for field, w, h in zip(("take", "entries", "order", "cap"), want, have, strict=True):
                    if w is None:
                        assert h is None, field
                        continue
                    assert h.dtype == w.dtype and h.shape == w.shape, (field, h, w)
                    assert torch.equal(h, w), (name, S, budget, trial, prompt_rows, field, h, w)


def test_a_binding_tpot_cap_and_ties_in_arrival_order_as_the_reference(kernels):
    """Every key tied but the index (the sort is stable), and a decode's TPOT SLO that leaves the prefills less than
    they ask: the cap binds, and the order is the slots' own."""
    S = 6
    state = Slots(S, 4096, 8, 16, torch.device("cpu"))
    state.seq_len.copy_(torch.tensor([101, 500, 500, 500, 500, 500]))
    state.num_computed.copy_(torch.tensor([100, 0, 0, 0, 0, 0]))
    state.prompt_len.fill_(100)
    state.tpot_slo.copy_(torch.tensor([0.5] + [float("inf")] * 5, dtype=torch.float64))
    cost = StepCost(torch.device("cpu"))
    cost.fit.copy_(torch.tensor([0.25, 2**-12], dtype=torch.float64))  # 0.5 s: 1024 tokens
    live = torch.ones(S, dtype=torch.bool)
    take, _, order, cap = kernels.hand_out(state, policy_named("slo"), cost, 4096, 0, live)
    assert int(cap) == 1024
    assert order.tolist() == [0, 1, 2, 3, 4, 5]
    assert take.tolist() == [1, 500, 500, 23, 0, 0]
    for got, want in zip((take, order, cap), (lambda r: (r[0], r[2], r[3]))(
            _hand_out(state, policy_named("slo"), cost, 4096, 0, live)), strict=True):
        assert torch.equal(got, want)


def _head_state(rng: random.Random, S: int) -> Slots:
    """_state's slots in every status, some rotated, paused, cancelled, fresh or holding pages."""
    state, _ = _state(rng, S)
    state.status.copy_(torch.tensor([rng.choice(list(SlotStatus)) for _ in range(S)]))
    state.spec_rate.copy_(torch.rand_like(state.spec_rate))
    for field, p in (("rotated", 0.2), ("paused", 0.1), ("cancel", 0.1)):
        getattr(state, field).copy_(torch.tensor([rng.random() < p for _ in range(S)]))
    state.num_computed.masked_fill_(torch.tensor([rng.random() < 0.4 for _ in range(S)]), 0)
    state.pages_held.copy_(torch.tensor([rng.choice([0, 0, 2]) for _ in range(S)]))
    return state


def _mirror(num_free: int, hold_below: int) -> SimpleNamespace:
    """What the plan's head reads of a host mirror: its free pages' count, and when it is nearly full (its own
    rule)."""
    mirror = SimpleNamespace(free=SimpleNamespace(num_free=torch.tensor(num_free)), hold_below=hold_below)
    mirror.nearly_full = lambda: HostMirror.nearly_full(mirror)
    return mirror


@pytest.mark.parametrize("name", POLICIES)
def test_the_head_kernel_starts_the_plan_as_the_reference_does(kernels, name):
    """_head's results (running, resident, precedence, live, starting) and its effects (the admitted slots' status
    and draft rate), with and without a host mirror (nearly full or not, rotated requests waiting or not)."""
    rng = random.Random(10 + POLICIES.index(name))
    policy = policy_named(name)
    for S in (1, 6, COMPARE_BLOCK + 3):
        for trial in range(4):
            state = _head_state(rng, S)
            for mirror in (None, _mirror(10, 4), _mirror(3, 4)):
                want_state, have_state = copy.deepcopy(state), copy.deepcopy(state)
                want = _head(want_state, policy, mirror)
                have = kernels.head(have_state, policy, mirror)
                for field, w, h in zip(("running", "resident", "precedence", "live", "starting"), want, have,
                                       strict=True):
                    assert h.dtype == w.dtype and torch.equal(h, w), (name, S, trial, mirror, field, h, w)
                for field in ("status", "spec_rate"):
                    assert torch.equal(getattr(have_state, field), getattr(want_state, field)), field
