"""The plan's tail as a Triton kernel (blink.engine.kernels.plan_tail.settle_take) against its torch reference
(scheduler._settle_take), in Triton's interpreter: the same waits, prompt entries and drafts for random slots,
with and without entries and drafts."""

from __future__ import annotations

import copy

import pytest
import torch

from blink.engine.core.policy import StepCost
from blink.engine.core.scheduler import _settle_take
from blink.engine.core.state import Slots
from blink.engine.kernels.plan_tail import settle_take


@pytest.mark.parametrize("S", [1, 5, 16, 100])
@pytest.mark.parametrize("with_entries, drafts", [(True, True), (False, False), (True, False)])
def test_the_kernel_settles_the_take_as_the_reference_does(S, with_entries, drafts):
    gen = torch.Generator().manual_seed(S)
    state = Slots(S, 64, 8, 16, torch.device("cpu"))
    state.wait_s.copy_(torch.rand(S, generator=gen, dtype=torch.float64))
    state.paused.copy_(torch.rand(S, generator=gen) < 0.2)
    state.draft_len.copy_(torch.randint(0, 5, (S,), generator=gen))
    running = torch.rand(S, generator=gen) < 0.7
    take = torch.where(torch.rand(S, generator=gen) < 0.4, 0, torch.randint(1, 9, (S,), generator=gen))
    entries = torch.randint(0, 4, (S,), generator=gen) if with_entries else None
    cost = StepCost(torch.device("cpu"))
    cost.values.copy_(torch.tensor([0.01, 0.0002, 0.0371], dtype=torch.float64))
    reference, before = copy.deepcopy(state), state.wait_s.clone()
    want = _settle_take(reference, running, take, entries, cost, drafts)
    got = settle_take(state, running, take, entries, cost, drafts)
    assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
    assert torch.equal(state.wait_s, reference.wait_s) and torch.equal(state.draft_len, reference.draft_len)
    idle = running & ~state.paused & (take == 0)
    assert torch.equal(state.wait_s != before, idle)  # the idle running slots waited this step, no other
    if S > 5:
        assert idle.any() and (~idle).any()
