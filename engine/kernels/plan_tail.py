"""What the plan settles once pages are found, as one Triton launch: blink.engine.core.scheduler._settle_take (the
torch reference: the idle running slots' wait, and no prompt entries or drafts for a slot that lost its pages; eight
to ten small ops, a kernel each in a captured step). One program over the slots. tests/engine/test_plan_tail_kernel.py
holds it to the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core.policy import StepCost
from blink.engine.core.state import Slots


@triton.jit(do_not_specialize=["S"])
def _settle_take(running, paused, take, entries, entries_out, wait_s, cost, draft_len, S, ENTRIES: tl.constexpr,
                 DRAFTS: tl.constexpr, BLOCK_S: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    real = s < S
    t = tl.load(take + s, mask=real, other=0)
    idle = real & (tl.load(running + s, mask=real, other=0) != 0) & (tl.load(paused + s, mask=real, other=1) == 0)
    since = tl.load(cost + 2)  # StepCost.since_last_plan
    wait = tl.load(wait_s + s, mask=real, other=0.0)
    tl.store(wait_s + s, wait + tl.where(idle & (t == 0), since, 0.0), mask=real)
    if ENTRIES:
        tl.store(entries_out + s, tl.where(t > 0, tl.load(entries + s, mask=real, other=0), 0), mask=real)
    if DRAFTS:
        tl.store(draft_len + s, tl.where(t == 0, 0, tl.load(draft_len + s, mask=real, other=0)), mask=real)


def settle_take(state: Slots, running: torch.Tensor, take: torch.Tensor, entries: torch.Tensor | None, cost: StepCost,
                drafts: bool) -> torch.Tensor | None:
    """scheduler._settle_take's arguments, effects and result."""
    out = None if entries is None else torch.empty_like(entries)
    _settle_take[(1,)](running, state.paused, take, take if entries is None else entries, take if out is None else out,
                       state.wait_s, cost.values, state.draft_len, state.num_slots, ENTRIES=entries is not None,
                       DRAFTS=drafts, BLOCK_S=triton.next_power_of_2(state.num_slots))
    return out
