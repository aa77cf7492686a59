"""Room for a step's pages as three Triton launches: blink.engine.core.paging.make_room (the torch reference: the new
pages each slot needs, the keep order, the victims' order, `_make_room`'s longest prefix that fits and its victims,
and without a mirror the evicted's counts; about ninety small ops, a kernel each in a captured step).

Each launch is a program per slot, and its last program to finish (it counts the others in by an atomic) does the
slot-level work over all slots, in one block:
1. `_order`: the slot's keep position (its place in `precedence`, the resident slots not cancelled ahead) and its
   victim position (a stable rank by the policy's victim keys: how many slots sort before it), both counted over all
   slots; with prefix caching, each page's first holder in keep order and last in victim order, by atomics.
2. `_first`: the pages each slot holds first (the count by keep position) and the latest first holder of its pages
   (a slot frees a page when it is past every kept one); last: the prefix that fits, the reserve and the deficit.
3. `_last`: the pages each victim is the last holder of that no kept slot maps, its holder's cells put back at rest;
   last: the victims in their order while short, the pages and tokens that remain, the evicted's counts.
tests/engine/test_make_room_kernel.py holds it to the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core import kv_cache
from blink.engine.core.kv_cache import PagePool
from blink.engine.core.policy import POLICIES, Policy
from blink.engine.core.state import Slots
from blink.engine.kernels.page_sharing import AT_REST

NULL_PAGE = tl.constexpr(kv_cache.NULL_PAGE)
FCFS, BY_PRIORITY, SLO = (tl.constexpr(POLICIES.index(name)) for name in ("fcfs", "priority", "slo"))
FIRST_REST, LAST_REST = tl.constexpr(AT_REST["amin"]), tl.constexpr(AT_REST["amax"])
# The scratch's [S] rows (by slot, or by keep or victim position), then its scalars: the two launches' counters, the
# kept prefix's length, the deficit and the reserve.
ROWS = ("kept_at", "victim_at", "keep", "victims", "firsts", "fits", "latest", "frees")
KEPT_AT, VICTIM_AT, KEEP, VICTIMS, FIRSTS, FITS, LATEST, FREES = (tl.constexpr(r) for r in range(len(ROWS)))
SCALARS = tl.constexpr(len(ROWS))
DONE_FIRST, DONE_LAST, KEPT, DEFICIT, RESERVE = (tl.constexpr(r) for r in range(5))


@triton.jit
def _needs(computed, take_ptr, held_ptr, slot, real, PAGE: tl.constexpr, MIRROR: tl.constexpr):
    """paging._pages_needed for these slots: (tokens, new pages, 1 where a slot starts a page next step)."""
    done = tl.load(computed + slot, mask=real, other=0)
    take = tl.load(take_ptr + slot, mask=real, other=0)
    need = tl.where(take > 0, tl.maximum((done + take + PAGE - 1) // PAGE - tl.load(held_ptr + slot, mask=real,
                                                                                       other=0), 0), 0)
    cross = ((take > 0) & ((done + take) % PAGE == 0)).to(tl.int64)
    if not MIRROR:
        cross = cross * 0
    return take, need, cross


@triton.jit
def _sorts_before(key, i, s, before):
    """Whether each slot sorts before slot s by `key`, then (on a tie) by `before`, the less significant keys'."""
    own = tl.sum(tl.where(i == s, key, 0))
    return (key < own) | ((key == own) & before)


@triton.jit
def _order(precedence, resident, cancel, service_class, priority, seq_len, prompt_len, arrival, held, table,
           scratch, first_ext, last_ext, S,
           WIDTH: tl.constexpr, POLICY: tl.constexpr, SHARED: tl.constexpr, BLOCK_S: tl.constexpr,
           BLOCK: tl.constexpr):
    s = tl.program_id(0)
    i = tl.arange(0, BLOCK_S)
    real = i < S
    if s == 0:
        tl.store(scratch + SCALARS * S + DONE_FIRST, 0)
        tl.store(scratch + SCALARS * S + DONE_LAST, 0)
    # Keep position (policy.ahead): the resident slots not cancelled first, each group in precedence's order.
    prec = tl.load(precedence + i, mask=real, other=0)
    at = tl.sum(tl.where(real & (prec == s), i, 0))
    first_at = real & (tl.load(resident + prec, mask=real, other=0) != 0) & (tl.load(cancel + prec, mask=real,
                                                                                      other=0) == 0)
    earlier = i < at
    mine = (tl.load(resident + s) != 0) & (tl.load(cancel + s) == 0)
    kept_at = tl.where(mine, tl.sum((first_at & earlier).to(tl.int64)),
                       tl.sum(first_at.to(tl.int64)) + tl.sum((real & ~first_at & earlier).to(tl.int64)))
    # Victim position (lexsort of policy.victim_keys, the resident cancelled ahead): how many slots sort before this
    # one, its keys compared from the least significant up (a stable sort: ties by index).
    before = _sorts_before(-tl.load(arrival + i, mask=real, other=0), i, s, i < s)
    if POLICY == SLO:  # the longest-running first
        generated = tl.load(seq_len + i, mask=real, other=0) - tl.load(prompt_len + i, mask=real, other=0)
        before = _sorts_before(-generated, i, s, before)
    if POLICY != FCFS:  # the lowest priority first (its value highest)
        before = _sorts_before(-tl.load(priority + i, mask=real, other=0), i, s, before)
    if POLICY == SLO:  # best-effort first
        before = _sorts_before(-tl.load(service_class + i, mask=real, other=0), i, s, before)
    gives = (tl.load(resident + i, mask=real, other=0) != 0) & (tl.load(cancel + i, mask=real, other=0) != 0)
    before = _sorts_before(tl.where(gives, 0, 1), i, s, before)
    victim_at = tl.sum((real & before).to(tl.int64))
    tl.store(scratch + KEPT_AT * S + s, kept_at)
    tl.store(scratch + VICTIM_AT * S + s, victim_at)
    tl.store(scratch + KEEP * S + kept_at, s)
    tl.store(scratch + VICTIMS * S + victim_at, s)
    if SHARED:  # each page's first holder in keep order, last in victim order
        n = tl.load(held + s)
        start = n * 0
        while start < n:
            j = start + tl.arange(0, BLOCK)
            pages = tl.load(table + s.to(tl.int64) * WIDTH + j, mask=j < n, other=NULL_PAGE)
            mapped = (j < n) & (pages != NULL_PAGE)
            tl.atomic_min(first_ext + pages, kept_at, mask=mapped)
            tl.atomic_max(last_ext + pages, victim_at, mask=mapped)
            start += BLOCK


@triton.jit
def _first(computed, take_ptr, held, table, num_free, scratch, first_ext, S,
           WIDTH: tl.constexpr, PAGE: tl.constexpr, MIRROR: tl.constexpr, SHARED: tl.constexpr,
           BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    n = tl.load(held + s)
    kept_at = tl.load(scratch + KEPT_AT * S + s)
    if SHARED:
        firsts = n * 0
        latest = n * 0 - 1  # the latest first holder (keep position) of the slot's pages; S for a null page
        start = n * 0
        while start < n:
            j = start + tl.arange(0, BLOCK)
            ours = j < n
            pages = tl.load(table + s.to(tl.int64) * WIDTH + j, mask=ours, other=NULL_PAGE)
            mapped = ours & (pages != NULL_PAGE)
            holder = tl.load(first_ext + pages, mask=mapped, other=-1)
            firsts += tl.sum((mapped & (holder == kept_at)).to(tl.int64))
            latest = tl.maximum(latest, tl.max(tl.where(mapped, holder, tl.where(ours, S, -1))))
            start += BLOCK
    else:  # no page is shared: a slot holds its own
        firsts = n
        latest = tl.where(n > 0, S, -1)
    tl.store(scratch + FIRSTS * S + kept_at, firsts)  # by keep position
    tl.store(scratch + LATEST * S + s, latest)
    tl.debug_barrier()  # every thread's stores issued before the ticket releases them
    # The last program to finish: the prefix that fits.
    if tl.atomic_add(scratch + SCALARS * S + DONE_FIRST, 1, sem="acq_rel", scope="gpu") == S - 1:
        k = tl.arange(0, BLOCK_S)
        real = k < S
        slot = tl.load(scratch + KEEP * S + k, mask=real, other=0)  # keep order
        _, need, cross = _needs(computed, take_ptr, held, slot, real, PAGE, MIRROR)
        firsts_o = tl.load(scratch + FIRSTS * S + k, mask=real, other=0, volatile=True)
        kept_by = tl.cumsum(firsts_o, 0)
        free = tl.load(num_free)
        fits = real & (tl.cumsum(need, 0) + tl.cumsum(cross, 0) - cross <= free + tl.sum(firsts_o) - kept_by)
        reserve = tl.sum(tl.where(fits, cross, 0))
        tl.store(scratch + FITS * S + slot, fits.to(tl.int64), mask=real)  # by slot
        tl.store(scratch + SCALARS * S + KEPT, tl.sum(fits.to(tl.int64)))  # a prefix: the sums only grow past it
        tl.store(scratch + SCALARS * S + DEFICIT, tl.sum(tl.where(fits, need, 0)) + reserve - free)
        tl.store(scratch + SCALARS * S + RESERVE, reserve)


@triton.jit
def _last(computed, take_ptr, held, table, cancel, preemptions, num_preemptions, num_recomputes, scratch,
          first_ext, last_ext, need_out, take_out, evicted_out, reserve_out, S,
          WIDTH: tl.constexpr, PAGE: tl.constexpr, MIRROR: tl.constexpr, SHARED: tl.constexpr,
          BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    n = tl.load(held + s)
    victim_at = tl.load(scratch + VICTIM_AT * S + s)
    kept = tl.load(scratch + SCALARS * S + KEPT)
    if SHARED:  # the pages whose last holder (victim order) this is, mapped by no kept slot: they free with it
        frees = n * 0
        start = n * 0
        while start < n:
            j = start + tl.arange(0, BLOCK)
            pages = tl.load(table + s.to(tl.int64) * WIDTH + j, mask=j < n, other=NULL_PAGE)
            mapped = (j < n) & (pages != NULL_PAGE)
            # A cell already put back reads as no holder (only its holder puts it back).
            holder = mapped & (tl.load(last_ext + pages, mask=mapped, other=-2, volatile=True) == victim_at)
            frees += tl.sum((holder & (tl.load(first_ext + pages, mask=holder, other=0) >= kept)).to(tl.int64))
            tl.store(first_ext + pages, FIRST_REST, mask=holder)
            tl.store(last_ext + pages, LAST_REST, mask=holder)
            start += BLOCK
    else:
        candidate = (tl.load(scratch + FITS * S + s) == 0) & (tl.load(scratch + LATEST * S + s) >= kept)
        frees = tl.where(candidate, n, 0)
    tl.store(scratch + FREES * S + victim_at, frees)  # by victim position
    tl.debug_barrier()  # every thread's stores issued before the ticket releases them
    # The last program to finish: victims while short.
    if tl.atomic_add(scratch + SCALARS * S + DONE_LAST, 1, sem="acq_rel", scope="gpu") == S - 1:
        v = tl.arange(0, BLOCK_S)
        real = v < S
        slot = tl.load(scratch + VICTIMS * S + v, mask=real, other=0)
        fits = tl.load(scratch + FITS * S + slot, mask=real, other=0) != 0
        # A slot past the prefix frees a page if one of its pages is past every kept slot's.
        candidate = real & ~fits & (tl.load(scratch + LATEST * S + slot, mask=real, other=-1) >= kept)
        frees_v = tl.load(scratch + FREES * S + v, mask=real, other=0, volatile=True)
        evicted = candidate & (tl.cumsum(frees_v, 0) - frees_v < tl.load(scratch + SCALARS * S + DEFICIT))
        take, need, _ = _needs(computed, take_ptr, held, slot, real, PAGE, MIRROR)
        runs = fits | ((need == 0) & ~evicted)  # past the prefix, a slot needing no new page runs on its own
        tl.store(need_out + slot, tl.where(fits, need, 0), mask=real)
        tl.store(take_out + slot, tl.where(runs, take, 0), mask=real)
        tl.store(evicted_out + slot, evicted, mask=real)
        tl.store(reserve_out, tl.load(scratch + SCALARS * S + RESERVE))
        if not MIRROR:  # paging._count_evictions: every evicted slot computes from the start again
            tl.store(computed + slot, 0, mask=evicted)
            preempted = evicted & (tl.load(cancel + slot, mask=real, other=0) == 0)
            tl.store(preemptions + slot, tl.load(preemptions + slot, mask=real, other=0) + preempted.to(tl.int64),
                     mask=real)
            count = tl.sum(preempted.to(tl.int64))
            tl.store(num_preemptions, tl.load(num_preemptions) + count)
            tl.store(num_recomputes, tl.load(num_recomputes) + count)


def make_room(state: Slots, pool: PagePool, policy: Policy, take: torch.Tensor, resident: torch.Tensor,
              precedence: torch.Tensor, mirror: bool):
    """paging.make_room's arguments and results: (new pages, tokens, evicted, reserve, keep order, victims' order)."""
    S, width = state.block_table.shape
    table, device = state.block_table, take.device
    assert table.stride(1) == 1 and table.stride(0) == width
    cache = pool.prefix_cache
    shared = cache is not None
    first_ext, last_ext = cache.extremes.unbind() if shared else (table, table)  # unused without sharing
    scratch = torch.empty(len(ROWS) * S + 5, dtype=torch.int64, device=device)
    need, take_out = torch.empty_like(take), torch.empty_like(take)
    evicted, reserve = torch.empty_like(resident), torch.empty((), dtype=torch.int64, device=device)
    block_s = triton.next_power_of_2(S)
    sizes = dict(SHARED=shared, BLOCK_S=block_s, BLOCK=min(1024, triton.next_power_of_2(width)))
    paging = dict(PAGE=pool.page_size, MIRROR=mirror)
    _order[(S,)](precedence, resident, state.cancel, state.service_class, state.priority, state.seq_len,
                 state.prompt_len, state.arrival, state.pages_held, table, scratch, first_ext, last_ext, S,
                 WIDTH=width, POLICY=POLICIES.index(policy.name), **sizes)
    _first[(S,)](state.num_computed, take, state.pages_held, table, pool.num_free, scratch, first_ext, S,
                 WIDTH=width, **paging, **sizes)
    _last[(S,)](state.num_computed, take, state.pages_held, table, state.cancel, state.preemptions,
                state.num_preemptions, state.num_recomputes, scratch, first_ext, last_ext, need, take_out, evicted,
                reserve, S, WIDTH=width, **paging, **sizes)
    rows = scratch[: len(ROWS) * S].view(len(ROWS), S)
    return need, take_out, evicted, reserve, rows[KEEP.value], rows[VICTIMS.value]
