"""Prefix caching's pages out and back as Triton kernels, one launch each: PrefixCache.release (a program per slot:
references dropped by atomics, each page its last reference leaves pushed onto the empty stack or the ring of cached
pages, a range reserved per block by one atomic) and PrefixCache.allocate (one program: the ring compacted when half
dead, its oldest live pages found by a scan from its head, the grants written slot by slot). With the hash table's
kernels (blink.engine.kernels.prefix_cache) they are `KERNELS`, which the device step sets as the cache's `kernels`.
tests/engine/test_prefix_cache_kernels.py holds them to the torch reference (blink.engine.core.prefix_cache), state
for state, in Triton's interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core import kv_cache
from blink.engine.kernels import page_sharing, prefix_cache

NULL_PAGE = tl.constexpr(kv_cache.NULL_PAGE)  # a kernel reads only constexpr globals


@triton.jit
def _release(which, table, held, refs, hashes, num_free, stack, empties, ring, head, tail, pos,
             WIDTH: tl.constexpr, RING: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    if not tl.load(which + s):
        return
    first = tl.load(head)  # allocation alone moves it
    row = table + s.to(tl.int64) * WIDTH
    end = tl.load(held + s)
    while end > 0:  # the slot's last page first: evicted first, they leave its prefix cached longest
        j = end - 1 - tl.arange(0, BLOCK)
        give = j >= 0
        pages = tl.load(row + j, mask=give, other=NULL_PAGE)
        before = tl.atomic_add(refs + pages, -1, mask=give)
        frees = give & (before == 1)
        cached = frees & (tl.load(hashes + pages, mask=frees, other=0) != 0)
        counter = tl.atomic_add(tail, tl.sum(cached.to(tl.int64))) + tl.cumsum(cached.to(tl.int64), 0) - 1
        kept = cached & (counter - first < RING)
        tl.store(ring + (counter & (RING - 1)), pages, mask=kept)
        tl.store(pos + pages, tl.where(kept, counter, -1), mask=cached)  # -1: no live entry, not an older one
        tl.store(hashes + pages, 0, mask=cached & ~kept)  # no room in the ring: it forgets its contents
        onto = frees & ~kept
        at = tl.atomic_add(empties, tl.sum(onto.to(tl.int64))) + tl.cumsum(onto.to(tl.int64), 0) - 1
        tl.store(stack + at, pages, mask=onto)
        tl.atomic_add(num_free, tl.sum(frees.to(tl.int64)))
        tl.store(row + j, NULL_PAGE, mask=give)
        end -= BLOCK
    tl.store(held + s, 0)


@triton.jit
def _live(ring, refs, pos, counter, end, RING: tl.constexpr):
    """The ring's pages at these counters, and whether each is live (its page free, its latest entry)."""
    inside = counter < end
    pages = tl.load(ring + (counter & (RING - 1)), mask=inside, other=NULL_PAGE)
    free = tl.load(refs + pages, mask=inside, other=1) == 0
    return pages, inside & free & (tl.load(pos + pages, mask=inside, other=-1) == counter)


@triton.jit
def _allocate(need, table, held, refs, hashes, num_free, stack, empties, ring, head, tail, pos, picked, S,
              WIDTH: tl.constexpr, MAX_NEW: tl.constexpr, RING: tl.constexpr, SB: tl.constexpr, MB: tl.constexpr,
              BLOCK: tl.constexpr):
    start = tl.load(head)
    end = tl.load(tail)
    if end - start > RING // 2:  # compaction: the live entries moved together from the head, in order
        written = start
        c = start
        stop = tl.minimum(end, start + RING)  # counters past a full ring were never written
        while c < stop:
            counter = c + tl.arange(0, BLOCK)
            pages, live = _live(ring, refs, pos, counter, stop, RING)
            to = written + tl.cumsum(live.to(tl.int64), 0) - 1
            tl.debug_barrier()  # every thread's reads of this block before any write into it
            tl.store(ring + (to & (RING - 1)), pages, mask=live)
            tl.store(pos + pages, to, mask=live)
            tl.debug_barrier()
            written += tl.sum(live.to(tl.int64))
            c += BLOCK
        end = written
        tl.store(tail, end)
    empty = tl.load(empties)
    k = tl.load(need) * 0
    sb = 0
    while sb < S:
        slots = sb + tl.arange(0, SB)
        k += tl.sum(tl.load(need + slots, mask=slots < S, other=0))
        sb += SB
    wanted = tl.maximum(k - empty, 0)  # pages from the ring, oldest live first
    got = k * 0
    new_head = start
    c = start
    stop = tl.minimum(end, start + RING)
    while (got < wanted) & (c < stop):
        counter = c + tl.arange(0, BLOCK)
        pages, live = _live(ring, refs, pos, counter, stop, RING)
        nth = got + tl.cumsum(live.to(tl.int64), 0) - 1
        take = live & (nth < wanted)
        tl.store(picked + nth, pages, mask=take)
        new_head = tl.maximum(new_head, tl.max(tl.where(take, counter + 1, 0)))
        got += tl.sum(take.to(tl.int64))
        c += BLOCK
    tl.debug_barrier()  # the picked pages stored before any thread reads them
    carry = k * 0
    sb = 0
    col = tl.arange(0, MB)
    while sb < S:
        slots = sb + tl.arange(0, SB)
        real = slots < S
        n = tl.load(need + slots, mask=real, other=0)
        have = tl.load(held + slots, mask=real, other=0)
        rank = (carry + tl.cumsum(n, 0) - n)[:, None] + col[None, :]
        grant = real[:, None] & (col[None, :] < n[:, None])
        from_stack = rank < empty
        pages = tl.where(from_stack, tl.load(stack + (empty - 1 - rank), mask=grant & from_stack, other=0),
                         tl.load(picked + (rank - empty), mask=grant & ~from_stack, other=0))
        tl.store(table + slots.to(tl.int64)[:, None] * WIDTH + have[:, None] + col[None, :], pages, mask=grant)
        tl.store(refs + pages, 1, mask=grant)
        tl.store(hashes + pages, 0, mask=grant)  # evicted: its old contents are about to be overwritten
        tl.store(pos + pages, -1, mask=grant)
        tl.store(held + slots, have + n, mask=real)
        carry += tl.sum(n)
        sb += SB
    tl.store(head, new_head)
    tl.store(empties, empty - tl.minimum(k, empty))
    tl.store(num_free, tl.load(num_free) - k)


def launch_release(cache, which: torch.Tensor, table: torch.Tensor, held: torch.Tensor) -> None:
    """PrefixCache.release's arguments and effects (`cache`: the PrefixCache)."""
    width = table.shape[1]
    assert table.stride(1) == 1 and table.stride(0) == width
    _release[(which.shape[0],)](which, table, held, cache.refs, cache.hash, cache.num_free, cache.stack,
                                cache.empties, cache.ring, cache.head, cache.tail, cache.pos, WIDTH=width,
                                RING=cache.ring_size, BLOCK=min(1024, triton.next_power_of_2(width)))


def launch_allocate(cache, need: torch.Tensor, table: torch.Tensor, held: torch.Tensor, max_new: int) -> None:
    """PrefixCache.allocate's arguments and effects."""
    width = table.shape[1]
    assert table.stride(1) == 1 and table.stride(0) == width
    S = need.shape[0]
    _allocate[(1,)](need, table, held, cache.refs, cache.hash, cache.num_free, cache.stack, cache.empties,
                    cache.ring, cache.head, cache.tail, cache.pos, cache.scratch[0], S, WIDTH=width, MAX_NEW=max_new,
                    RING=cache.ring_size, SB=min(64, triton.next_power_of_2(S)),
                    MB=triton.next_power_of_2(max(max_new, 1)), BLOCK=1024)


class _Kernels:
    """PrefixCache's four methods as launches, and blink.engine.core.page_sharing's two."""

    allocate, release = staticmethod(launch_allocate), staticmethod(launch_release)
    reuse, register = staticmethod(prefix_cache.launch_reuse), staticmethod(prefix_cache.launch_register)
    frees_a_page = staticmethod(page_sharing.frees_a_page)
    pages_by_position = staticmethod(page_sharing.pages_by_position)


KERNELS = _Kernels()
