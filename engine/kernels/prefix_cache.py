"""Prefix caching's hash table as Triton kernels, one launch each (blink.engine.core.prefix_cache is the torch
reference and says how the table works): PrefixCache.reuse, a program per slot probing its prompt's hashes a block at
a time up to the first miss, references taken by atomics (`reuse_prefix`: the same launch doing the plan's part too,
scheduler._reuse_prefix); PrefixCache.register, one program: the completed pages
listed (their hashes set), then inserted in rounds, a contested cell going to the lowest item by an atomic minimum.
Scratch lives on the cache (`scratch`, `claims`: the claims are left as found). blink.engine.kernels.page_release
gathers them with the release and the allocation."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from blink.engine.core import kv_cache
from blink.engine.core import prefix_cache as reference

if TYPE_CHECKING:
    from blink.engine.core.state import Slots

NULL_PAGE = tl.constexpr(kv_cache.NULL_PAGE)
NO_CLAIM = tl.constexpr(reference.NO_CLAIM)


@triton.jit
def _window(values, TABLE: tl.constexpr, PROBES: tl.constexpr):
    """[N, PROBES] the table cells each hash may lie in."""
    return ((values & (TABLE - 1))[:, None] + tl.arange(0, PROBES)[None, :]) & (TABLE - 1)


@triton.jit
def _first(mask, values, PROBES: tl.constexpr):
    """Per row: whether a cell is set in `mask`, and `values` at the first that is."""
    index = tl.min(tl.where(mask, tl.arange(0, PROBES)[None, :], PROBES), axis=1)
    return index < PROBES, tl.sum(tl.where(tl.arange(0, PROBES)[None, :] == index[:, None], values, 0), axis=1)


@triton.jit
def _reuse(hashes, prompt_len, which, table, held, computed, found, refs, page_hash, slots, num_free, H, asks,
           preemptions, cached, WIDTH: tl.constexpr, PAGE: tl.constexpr, TABLE: tl.constexpr, PROBES: tl.constexpr,
           HB: tl.constexpr, SLOTS: tl.constexpr):
    """A program per slot. SLOTS: scheduler._reuse_prefix's part too, read from the slot state: a slot that asks
    for its prompt's logprobs (asks >= 0) takes nothing, and a first start (no preemptions) records its hit."""
    s = tl.program_id(0)
    run = tl.load(held + s) * 0
    go = tl.load(which + s) != 0
    if SLOTS:
        go = go & (tl.load(asks + s) < 0)
    if go:
        usable = tl.minimum(tl.maximum((tl.load(prompt_len + s) - 1) // PAGE, 0), H)
        start = run
        while start < usable:
            j = start + tl.arange(0, HB)
            queried = j < usable
            query = tl.load(hashes + s.to(tl.int64) * H + j, mask=queried, other=0)
            cells = tl.load(slots + _window(query, TABLE, PROBES), mask=queried[:, None], other=NULL_PAGE)
            match = queried[:, None] & (tl.load(page_hash + cells) == query[:, None])
            hit, pages = _first(match, cells, PROBES)
            miss = tl.min(tl.where(queried & ~hit, j, usable))  # pages found without a gap from the first
            mapped = j < miss
            tl.store(table + s.to(tl.int64) * WIDTH + j, pages, mask=mapped)
            before = tl.atomic_add(refs + pages, 1, mask=mapped)
            tl.atomic_add(num_free, -tl.sum((mapped & (before == 0)).to(tl.int64)))  # a free page taken
            run += tl.sum(mapped.to(tl.int64))
            start = tl.where(miss < usable, usable, start + HB)
        tl.store(held + s, tl.load(held + s) + run)
        tl.store(computed + s, tl.load(computed + s) + run * PAGE)
    tl.store(found + s, run * PAGE)
    if SLOTS:
        tl.store(cached + s, run * PAGE, mask=go & (tl.load(preemptions + s) == 0))


@triton.jit
def _register(hashes, prompt_len, before, after, table, page_hash, slots, claims, items, S, H, CAP,
              WIDTH: tl.constexpr, PAGE: tl.constexpr, MAX_NEW: tl.constexpr, TABLE: tl.constexpr,
              PROBES: tl.constexpr, SB: tl.constexpr, MB: tl.constexpr, IB: tl.constexpr):
    # items: [4, CAP] each item's page, hash, whether pending, the cell it proposed (-1: none)
    item_page, item_hash, item_pending, item_cell = items, items + CAP, items + 2 * CAP, items + 3 * CAP
    count = tl.load(before) * 0
    col = tl.arange(0, MB)
    sb = 0
    while sb < S:  # the pages completed, slot by slot, listed; their hashes set
        s = sb + tl.arange(0, SB)
        real = s < S
        full = tl.minimum(tl.load(after + s, mask=real, other=0), tl.load(prompt_len + s, mask=real, other=0)) // PAGE
        first = tl.load(before + s, mask=real, other=0) // PAGE
        n = tl.minimum(tl.maximum(full - first, 0), MAX_NEW)
        new = col[None, :] < n[:, None]
        j = first[:, None] + col[None, :]
        pages = tl.load(table + s.to(tl.int64)[:, None] * WIDTH + tl.minimum(j, WIDTH - 1), mask=new, other=0)
        values = tl.load(hashes + s.to(tl.int64)[:, None] * H + tl.minimum(j, H - 1), mask=new, other=0)
        tl.store(page_hash + pages, values, mask=new)
        at = (count + tl.cumsum(n, 0) - n)[:, None] + col[None, :]
        tl.store(item_page + at, pages, mask=new)
        tl.store(item_hash + at, values, mask=new)
        tl.store(item_pending + at, (values != 0).to(tl.int64), mask=new)
        count += tl.sum(n)
        sb += SB
    tl.debug_barrier()
    for _ in tl.static_range(PROBES):
        i0 = 0
        while i0 < count:  # each pending item proposes its window's first free cell
            i = i0 + tl.arange(0, IB)
            pending = (tl.load(item_pending + i, mask=i < count, other=0) != 0)
            values = tl.load(item_hash + i, mask=pending, other=0)
            window = _window(values, TABLE, PROBES)
            cells = tl.load(slots + window, mask=pending[:, None], other=NULL_PAGE)
            holds = tl.load(page_hash + cells)
            present = tl.max(((holds == values[:, None]) & (cells != NULL_PAGE)).to(tl.int32), axis=1) != 0
            free = (cells == NULL_PAGE) | (holds == 0) | (((window - (holds & (TABLE - 1))) & (TABLE - 1)) >= PROBES)
            has_free, cell = _first(free, window, PROBES)
            propose = pending & ~present & has_free
            tl.atomic_min(claims + cell, i.to(tl.int64), mask=propose)
            tl.store(item_cell + i, tl.where(propose, cell, -1), mask=i < count)
            i0 += IB
        tl.debug_barrier()
        i0 = 0
        while i0 < count:  # the lowest item proposing a cell takes it
            i = i0 + tl.arange(0, IB)
            cell = tl.load(item_cell + i, mask=i < count, other=-1)
            propose = cell >= 0
            won = propose & (tl.load(claims + cell, mask=propose, other=-1, volatile=True) == i)
            tl.store(slots + cell, tl.load(item_page + i, mask=won, other=0), mask=won)
            tl.store(item_pending + i, (propose & ~won).to(tl.int64), mask=i < count)
            i0 += IB
        tl.debug_barrier()
        i0 = 0
        while i0 < count:
            i = i0 + tl.arange(0, IB)
            cell = tl.load(item_cell + i, mask=i < count, other=-1)
            tl.store(claims + cell, NO_CLAIM, mask=cell >= 0)
            i0 += IB
        tl.debug_barrier()


def launch_reuse(cache, hashes: torch.Tensor, prompt_len: torch.Tensor, which: torch.Tensor, table: torch.Tensor,
                 held: torch.Tensor, computed: torch.Tensor) -> torch.Tensor:
    """PrefixCache.reuse's arguments, effects and result."""
    found = torch.empty_like(held)
    _launch_reuse(cache, hashes, prompt_len, which, table, held, computed, found)
    return found


def reuse_prefix(state: Slots, cache, starting: torch.Tensor) -> None:
    """scheduler._reuse_prefix's arguments and effects, in PrefixCache.reuse's one launch."""
    _launch_reuse(cache, state.page_hashes, state.prompt_len, starting, state.block_table, state.pages_held,
                  state.num_computed, torch.empty_like(state.pages_held), state)


def _launch_reuse(cache, hashes: torch.Tensor, prompt_len: torch.Tensor, which: torch.Tensor, table: torch.Tensor,
                  held: torch.Tensor, computed: torch.Tensor, found: torch.Tensor, state: Slots | None = None) -> None:
    S, H = hashes.shape
    width = table.shape[1]
    assert hashes.is_contiguous() and table.stride(1) == 1 and table.stride(0) == width
    slot_state = (found,) * 3 if state is None else (state.prompt_logprobs, state.preemptions, state.cached_tokens)
    _reuse[(S,)](hashes, prompt_len, which, table, held, computed, found, cache.refs, cache.hash, cache.slots,
                 cache.num_free, H, *slot_state, WIDTH=width, PAGE=cache.page_size, TABLE=cache.table_size,
                 PROBES=reference.PROBES, HB=min(64, triton.next_power_of_2(H)), SLOTS=state is not None)


def launch_register(cache, hashes: torch.Tensor, prompt_len: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
                    table: torch.Tensor, max_new: int) -> None:
    """PrefixCache.register's arguments and effects."""
    S, H = hashes.shape
    width = table.shape[1]
    assert hashes.is_contiguous() and table.stride(1) == 1 and table.stride(0) == width
    _register[(1,)](hashes, prompt_len, before, after, table, cache.hash, cache.slots, cache.claims, cache.scratch,
                    S, H, cache.num_pages, WIDTH=width, PAGE=cache.page_size, MAX_NEW=max_new,
                    TABLE=cache.table_size, PROBES=reference.PROBES, SB=min(64, triton.next_power_of_2(S)),
                    MB=triton.next_power_of_2(max(max_new, 1)), IB=128)
