"""The drafts' proposal for the CPU's host mode in one C++ call (cpu_draft.cpp's blink_cpu::plan_drafts), in place of
its torch reference, blink.engine.core.speculation.Speculation.draft (about 170 small ops, a few microseconds of
dispatch each): the same arguments (the speculation first), effects and result. engine/kernels/draft.py is its Triton
twin for the device step; tests/engine/test_cpu_draft.py holds this one to the reference."""

from __future__ import annotations

import torch

from blink.engine.core.kv_cache import PagePool
from blink.engine.core.policy import Policy, Slo, StepCost
from blink.engine.core.speculation import MIN_RATE, RETRY
from blink.engine.core.state import Slots
from blink.engine.kernels.cpu import ops


def draft(speculation, state: Slots, pool: PagePool, policy: Policy, cost: StepCost, take: torch.Tensor,
          live: torch.Tensor, order: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Speculation.draft's arguments (the speculation first), effects and result: [S] draft tokens each slot
    computes on top of `take`, written after its sequence in state.tokens, with state.draft_len, state.draft_n (the
    match length each slot's drafts followed) and the retrying slots' state.spec_rate (their match length's column)."""
    return ops().plan_drafts(
        live, take, order, cap, state.seq_len, state.num_computed, state.max_tokens, state.repetition_penalty,
        state.presence_penalty, state.frequency_penalty, state.prompt_logprobs, state.scored, state.prompt_len,
        state.draft_off, state.service_class, state.room, state.pages_held, cost.values, pool.num_free, state.tokens,
        state.draft_len, state.draft_n, state.spec_rate, speculation.k, speculation.lookup, speculation.lookup_min,
        speculation.lookup_max, speculation.token_share, speculation.draft_ratio, pool.page_size,
        isinstance(policy, Slo),  # the one policy whose latency-sensitive slots (service class 0) count their own kind
        RETRY, MIN_RATE)
