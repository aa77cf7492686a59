"""The plan's head and token hand-out as the CPU's C++ kernels (cpu_hand_out.cpp), one call each in place of the
torch references' dozens of small ops in the host mode: `head` is blink.engine.core.scheduler._head, `hand_out` is
scheduler._hand_out, each with its reference's arguments, results and effects (blink.engine.kernels.hand_out holds
the device step's Triton twins). tests/engine/test_hand_out_kernel.py and test_cpu_hand_out.py hold them to the
references."""

from __future__ import annotations

import torch

from blink.engine.core.policy import MIN_CAPPED_TOKENS, POLICIES, PRIORITY, PRIORITY_BITS, Policy, StepCost
from blink.engine.core.rotation import HostMirror
from blink.engine.core.state import FIRST_RATE, Slots
from blink.engine.kernels import cpu

_POLICY = {name: index for index, name in enumerate(POLICIES)}  # the C++ kernels' policy codes


def head(state: Slots, policy: Policy, mirror: HostMirror | None):
    """scheduler._head's arguments and results: (running, resident, precedence, live, starting)."""
    return cpu.ops().plan_head.default(
        state.status, state.spec_rate, state.rotated, state.paused, state.cancel, state.num_computed,
        state.pages_held, state.service_class, state.priority, state.ttft_deadline, state.arrival,
        None if mirror is None else mirror.free.num_free, 0 if mirror is None else mirror.hold_below,
        _POLICY[policy.name], PRIORITY.ge, PRIORITY_BITS, FIRST_RATE)


def hand_out(state: Slots, policy: Policy, cost: StepCost, token_budget: int, prompt_rows: int,
             live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """scheduler._hand_out's arguments and results: (take, entries or None, order, cap)."""
    return cpu.ops().plan_hand_out.default(
        live, state.seq_len, state.num_computed, state.prompt_logprobs, state.scored, state.prompt_len, state.room,
        state.service_class, state.priority, state.ttft_deadline, state.arrival, state.tpot_slo, cost.values,
        token_budget, min(token_budget, max(state.num_slots, MIN_CAPPED_TOKENS)), prompt_rows, _POLICY[policy.name],
        PRIORITY.ge, PRIORITY_BITS)
