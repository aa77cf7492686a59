"""The plan's head as two Triton kernels, one program over all slots each, the prefix cache's reuse between them:
`head` is blink.engine.core.scheduler._head (admitted slots start; the policy's order for pages; which slots may
compute, and which start now), `hand_out` is scheduler._hand_out (each slot's demand, the policy's budget order by a
stable lexsort, its token cap, the budget handed out in that order and the prompt logprobs cut to the step's rows);
about a hundred small ops of the torch references, a kernel each in a captured step. A stable sort is by ranks: a
slot's rank is how many slots sort before it (keys lexicographically less, or equal at a lower index), counted in
blocks of compares, and order[rank] = slot; the hand-out then runs in that order, gathered through it.
tests/engine/test_hand_out_kernel.py holds both to the references."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core.policy import MIN_CAPPED_TOKENS, POLICIES, PRIORITY, PRIORITY_BITS, Policy, StepCost
from blink.engine.core.rotation import HostMirror
from blink.engine.core.state import FIRST_RATE, Slots, SlotStatus

FCFS, BY_PRIORITY, SLO = (tl.constexpr(POLICIES.index(name)) for name in ("fcfs", "priority", "slo"))
ADMITTED, RUNNING = tl.constexpr(int(SlotStatus.ADMITTED)), tl.constexpr(int(SlotStatus.RUNNING))
COMPARE_BLOCK = 64  # slots compared against as many others at a time while ranking


@triton.jit
def _keys(idx, real, demand_ptr, service_class, priority, ttft_deadline, arrival, prio_base,
          POLICY: tl.constexpr, PRIO_BITS: tl.constexpr, BUDGET: tl.constexpr):
    """The policy's keys as lexsort sorts them: the small ones packed into one int64 as it packs them, then (slo) the
    TTFT deadline, then the arrival. BUDGET: policy.budget_keys with `first` (demand > 0); else keep_keys (no first)."""
    later = tl.full(idx.shape, 1, tl.int64)  # ~first, with no slot first
    prefill = tl.zeros(idx.shape, tl.int64)
    if BUDGET:
        demand = tl.load(demand_ptr + idx, mask=real, other=0)
        later = (demand <= 0).to(tl.int64)
        prefill = (demand > 1).to(tl.int64)
    head = later
    if POLICY == SLO:
        head = head << 1 | tl.load(service_class + idx, mask=real, other=0)
    if BUDGET:
        head = head << 1 | prefill
    if POLICY != FCFS:
        head = head << PRIO_BITS | (tl.load(priority + idx, mask=real, other=0) - prio_base)
    deadline = tl.zeros(idx.shape, tl.float64)  # fcfs and priority: no deadline
    if POLICY == SLO:
        deadline = tl.load(ttft_deadline + idx, mask=real, other=0.0)
    return head, deadline, tl.load(arrival + idx, mask=real, other=0)


@triton.jit
def _rank(order_ptr, rank_ptr, demand_ptr, service_class, priority, ttft_deadline, arrival, S, prio_base,
          POLICY: tl.constexpr, PRIO_BITS: tl.constexpr, BUDGET: tl.constexpr, STORE_RANK: tl.constexpr,
          BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
    """The stable lexsort by ranks: order[rank] = slot (and rank[slot] = its rank, where STORE_RANK)."""
    for i0 in range(0, BLOCK_S, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        head_i, deadline_i, arrival_i = _keys(i, i < S, demand_ptr, service_class, priority, ttft_deadline, arrival,
                                              prio_base, POLICY, PRIO_BITS, BUDGET)
        rank = tl.zeros((BLOCK,), tl.int32)
        for j0 in range(0, BLOCK_S, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            head_j, deadline_j, arrival_j = _keys(j, j < S, demand_ptr, service_class, priority, ttft_deadline,
                                                  arrival, prio_base, POLICY, PRIO_BITS, BUDGET)
            hj, hi = head_j[:, None], head_i[None, :]
            dj, di = deadline_j[:, None], deadline_i[None, :]
            aj, ai = arrival_j[:, None], arrival_i[None, :]
            tie = (aj < ai) | ((aj == ai) & (j[:, None] < i[None, :]))
            if POLICY == SLO:
                tie = (dj < di) | ((dj == di) & tie)
            before = ((hj < hi) | ((hj == hi) & tie)) & (j < S)[:, None]
            rank += tl.sum(before.to(tl.int32), 0)
        tl.store(order_ptr + rank, i.to(tl.int64), mask=i < S)
        if STORE_RANK:
            tl.store(rank_ptr + i, rank.to(tl.int64), mask=i < S)


@triton.jit(do_not_specialize=["S", "hold_below"])
def _head(status_ptr, spec_rate_ptr, rates_stride, rotated_ptr, paused_ptr, cancel_ptr, computed_ptr, held_ptr,
          service_class, priority, ttft_deadline, arrival, mirror_free,
          running_ptr, resident_ptr, precedence_ptr, rank_ptr, live_ptr, starting_ptr,
          S, hold_below, prio_base,
          POLICY: tl.constexpr, PRIO_BITS: tl.constexpr, MIRROR: tl.constexpr, RATES: tl.constexpr,
          FIRST_RATE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    real = s < S
    status = tl.load(status_ptr + s, mask=real, other=0)
    admitted = real & (status == ADMITTED)  # start RUNNING, their drafts' rates at FIRST_RATE
    tl.store(status_ptr + s, tl.full((BLOCK_S,), RUNNING, tl.int64), mask=admitted)
    rates = tl.arange(0, RATES)  # the whole row: every match length's rate
    tl.store(spec_rate_ptr + s.to(tl.int64)[:, None] * rates_stride + rates[None, :],
             tl.full((BLOCK_S, RATES), FIRST_RATE, tl.float32), mask=admitted[:, None])
    running = real & ((status == RUNNING) | admitted)
    rotated = tl.load(rotated_ptr + s, mask=real, other=0) != 0
    paused = tl.load(paused_ptr + s, mask=real, other=0) != 0
    cancel = tl.load(cancel_ptr + s, mask=real, other=0) != 0
    resident = running & ~rotated
    _rank(precedence_ptr, rank_ptr, precedence_ptr, service_class, priority, ttft_deadline, arrival, S, prio_base,
          POLICY, PRIO_BITS, False, MIRROR, BLOCK_S, BLOCK)  # the policy's order alone
    fresh = resident & (tl.load(computed_ptr + s, mask=real, other=1) == 0) & (tl.load(held_ptr + s, mask=real,
                                                                                       other=1) == 0)
    held_back = tl.zeros((BLOCK_S,), tl.int1)
    if MIRROR:  # scheduler._hold_new
        tl.debug_barrier()  # every slot's rank is stored
        rank = tl.load(rank_ptr + s, mask=real, other=0)
        waiting = rotated & running & ~cancel & ~paused
        behind = rank > tl.min(tl.where(waiting, rank, S), 0)
        nearly_full = tl.load(mirror_free) < hold_below
        held = (nearly_full & (tl.max(waiting.to(tl.int32), 0) > 0)) | behind
        if POLICY == SLO:
            held = held & (tl.load(service_class + s, mask=real, other=0) != 0)  # the latency-sensitive start
        held_back = fresh & held
    tl.store(running_ptr + s, running, mask=real)
    tl.store(resident_ptr + s, resident, mask=real)
    tl.store(live_ptr + s, resident & ~paused & ~cancel & ~held_back, mask=real)
    tl.store(starting_ptr + s, fresh & ~held_back & ~cancel, mask=real)


@triton.jit(do_not_specialize=["S", "budget", "floor", "prompt_rows"])  # no recompile for a value of 1
def _hand_out(live_ptr, seq_len_ptr, computed_ptr, prompt_logprobs_ptr, scored_ptr, prompt_len_ptr, room_ptr,
              service_class, priority, ttft_deadline, arrival, tpot_slo, cost,
              demand_ptr, take_ptr, entries_ptr, order_ptr, cap_ptr,
              S, budget, floor, prompt_rows, prio_base,
              POLICY: tl.constexpr, SCORING: tl.constexpr, PRIO_BITS: tl.constexpr,
              BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    real = s < S
    live = tl.load(live_ptr + s, mask=real, other=0) != 0
    computed = tl.load(computed_ptr + s, mask=real, other=0)
    demand = tl.where(live, tl.load(seq_len_ptr + s, mask=real, other=0) - computed, 0)
    if SCORING:  # a request that publishes its prompt's logprobs computes no more than its window has room for
        asks = tl.load(prompt_logprobs_ptr + s, mask=real, other=-1) >= 0
        scoring = asks & (tl.load(scored_ptr + s, mask=real, other=0) < tl.load(prompt_len_ptr + s, mask=real) - 1)
        demand = tl.where(scoring, tl.minimum(demand, tl.load(room_ptr + s, mask=real, other=0)), demand)
    tl.store(demand_ptr + s, demand, mask=real)

    if POLICY == SLO:  # policy.Slo.token_cap: the tightest TPOT SLO of the decoding slots, by the step-time model
        tpot = tl.load(tpot_slo + s, mask=real, other=float("inf"))
        tightest = tl.min(tl.where(real & (demand == 1), tpot, float("inf")), 0)
        tokens = (tightest - tl.load(cost)) / tl.load(cost + 1)
        tokens = tl.where((tokens != tokens) | (tokens == float("inf")), budget.to(tl.float64), tokens)
        cap = tl.minimum(tl.maximum(tl.floor(tokens), floor.to(tl.float64)), budget.to(tl.float64)).to(tl.int64)
    else:
        cap = budget.to(tl.int64)
    tl.store(cap_ptr, cap)
    tl.debug_barrier()  # the demands stored are every block's keys below

    _rank(order_ptr, order_ptr, demand_ptr, service_class, priority, ttft_deadline, arrival, S, prio_base,
          POLICY, PRIO_BITS, True, False, BLOCK_S, BLOCK)  # the budget's order
    tl.debug_barrier()  # the whole order is stored before any slot reads it back

    # In the budget's order: each slot takes what the cap leaves after those before it.
    slot = tl.load(order_ptr + s, mask=real, other=0)
    wanted = tl.load(demand_ptr + slot, mask=real, other=0)
    take = tl.minimum(tl.maximum(cap - (tl.cumsum(wanted, 0) - wanted), 0), wanted)
    if SCORING:  # scheduler._score_prompts: the prompt rows handed out in the same order
        computed = tl.load(computed_ptr + slot, mask=real, other=0)
        start = tl.maximum(computed, tl.load(scored_ptr + slot, mask=real, other=0))
        asks = real & (tl.load(prompt_logprobs_ptr + slot, mask=real, other=-1) >= 0)
        last = tl.load(prompt_len_ptr + slot, mask=real, other=0) - 1
        entries = tl.where(asks, tl.maximum(tl.minimum(computed + take, last) - start, 0), 0)
        allowed = tl.maximum(prompt_rows - (tl.cumsum(entries, 0) - entries), 0)
        take = tl.where(entries > allowed, tl.maximum(start + allowed - computed, 0), take)
        tl.store(entries_ptr + slot, tl.minimum(entries, allowed), mask=real)
    tl.store(take_ptr + slot, take, mask=real)


def hand_out(state: Slots, policy: Policy, cost: StepCost, token_budget: int, prompt_rows: int,
             live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """scheduler._hand_out's arguments and results: (take, entries or None, order, cap)."""
    S, device = state.num_slots, live.device

    def new(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int64, device=device)

    demand, take, order, cap = new(S), new(S), new(S), new()
    entries = new(S) if prompt_rows else None
    block_s = triton.next_power_of_2(S)
    _hand_out[(1,)](
        live, state.seq_len, state.num_computed, state.prompt_logprobs, state.scored, state.prompt_len, state.room,
        state.service_class, state.priority, state.ttft_deadline, state.arrival, state.tpot_slo, cost.values,
        demand, take, take if entries is None else entries, order, cap,
        S, token_budget, min(token_budget, max(S, MIN_CAPPED_TOKENS)), prompt_rows, PRIORITY.ge,
        POLICY=POLICIES.index(policy.name), SCORING=bool(prompt_rows), PRIO_BITS=PRIORITY_BITS,
        BLOCK_S=block_s, BLOCK=min(block_s, COMPARE_BLOCK))
    return take, entries, order, cap


def head(state: Slots, policy: Policy, mirror: HostMirror | None):
    """scheduler._head's arguments and results: (running, resident, precedence, live, starting)."""
    S, device = state.num_slots, state.status.device
    running, resident, live, starting = (torch.empty(S, dtype=torch.bool, device=device) for _ in range(4))
    precedence, rank = (torch.empty(S, dtype=torch.int64, device=device) for _ in range(2))
    block_s = triton.next_power_of_2(S)
    _head[(1,)](
        state.status, state.spec_rate, state.spec_rate.stride(0), state.rotated, state.paused, state.cancel,
        state.num_computed, state.pages_held, state.service_class, state.priority, state.ttft_deadline, state.arrival,
        rank if mirror is None else mirror.free.num_free, running, resident, precedence, rank, live, starting,
        S, 0 if mirror is None else mirror.hold_below, PRIORITY.ge, POLICY=POLICIES.index(policy.name),
        PRIO_BITS=PRIORITY_BITS, MIRROR=mirror is not None, RATES=state.spec_rate.shape[1], FIRST_RATE=FIRST_RATE,
        BLOCK_S=block_s,
        BLOCK=min(block_s, COMPARE_BLOCK))
    return running, resident, precedence, live, starting
