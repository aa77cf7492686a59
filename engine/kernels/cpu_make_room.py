"""Room for a step's pages on the CPU in one C++ call (cpu_make_room.cpp): blink.engine.core.paging.make_room, the
torch reference, with its arguments, results and effects on the state, for the host mode's plan (PlanKernels'
make_room), where the reference's ~90 small ops cost a few microseconds of dispatch each.
tests/engine/test_make_room_kernel.py holds it to the reference."""

from __future__ import annotations

import torch

from blink.engine.core.kv_cache import NULL_PAGE, PagePool
from blink.engine.core.policy import Policy
from blink.engine.core.state import Slots
from blink.engine.kernels import cpu


def make_room(state: Slots, pool: PagePool, policy: Policy, take: torch.Tensor, resident: torch.Tensor,
              precedence: torch.Tensor, mirror: bool):
    """paging.make_room's arguments and results: (new pages, tokens, evicted, reserve, keep order, the victims'
    order or None when nobody gives any back); without a mirror the evicted are counted too."""
    return cpu.ops().make_room(state.num_computed, state.pages_held, state.block_table, state.cancel,
                               state.service_class, state.priority, state.seq_len, state.prompt_len, state.arrival,
                               state.preemptions, state.num_preemptions, state.num_recomputes, take, resident,
                               precedence, pool.num_free, pool.page_size, pool.num_pages,
                               pool.prefix_cache is not None, NULL_PAGE, policy.name, mirror)
