"""Who maps which KV page (blink.engine.core.page_sharing, the torch reference) as Triton kernels, a program per slot,
with no pass over the pool: `frees_a_page` marks the pages kept slots map with a fresh epoch (its one torch op), then
each slot looks for a page of its own unmarked; `pages_by_position` takes each page's first (or last) holder's
position by atomics into `extremes`, then each slot counts the pages whose holder it is and puts their cells back
(a holder reading a cell already put back is no holder, so no other pass is needed). The cache's `extremes` and
`mark` hold their rest values between calls. tests/engine/test_page_sharing_kernels.py holds them to the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core import kv_cache

NULL_PAGE = tl.constexpr(kv_cache.NULL_PAGE)
AT_REST = {"amin": torch.iinfo(torch.int64).max, "amax": -1}  # an `extremes` cell's value between calls


@triton.jit
def _mark(held, table, kept, mark, epoch, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    if tl.load(kept + s):
        n = tl.load(held + s)
        stamp = tl.load(epoch)
        start = n * 0
        while start < n:
            j = start + tl.arange(0, BLOCK)
            pages = tl.load(table + s.to(tl.int64) * WIDTH + j, mask=j < n, other=NULL_PAGE)
            tl.store(mark + pages, stamp, mask=(j < n) & (pages != NULL_PAGE))
            start += BLOCK


@triton.jit
def _frees(held, table, mark, epoch, out, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    n = tl.load(held + s)
    stamp = tl.load(epoch)
    frees = n * 0
    start = n * 0
    while start < n:
        j = start + tl.arange(0, BLOCK)
        mine = j < n
        pages = tl.load(table + s.to(tl.int64) * WIDTH + j, mask=mine, other=NULL_PAGE)
        kept = tl.load(mark + pages, mask=mine, other=0) == stamp
        frees += tl.sum((mine & ((pages == NULL_PAGE) | ~kept)).to(tl.int64))
        start += BLOCK
    tl.store(out + s, frees > 0)


@triton.jit
def _extreme(held, table, position, extremes, counts, S, WIDTH: tl.constexpr, LAST: tl.constexpr,
             BLOCK: tl.constexpr):
    s = tl.program_id(0)
    tl.store(counts + s, 0)
    if s == 0:
        tl.store(counts + S, 0)
    n = tl.load(held + s)
    at = tl.load(position + s)
    start = n * 0
    while start < n:
        j = start + tl.arange(0, BLOCK)
        pages = tl.load(table + s.to(tl.int64) * WIDTH + j, mask=j < n, other=NULL_PAGE)
        mapped = (j < n) & (pages != NULL_PAGE)
        if LAST:
            tl.atomic_max(extremes + pages, at, mask=mapped)
        else:
            tl.atomic_min(extremes + pages, at, mask=mapped)
        start += BLOCK


@triton.jit
def _count(held, table, position, extremes, counts, WIDTH: tl.constexpr, REST: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    n = tl.load(held + s)
    at = tl.load(position + s)
    total = n * 0
    start = n * 0
    while start < n:
        j = start + tl.arange(0, BLOCK)
        pages = tl.load(table + s.to(tl.int64) * WIDTH + j, mask=j < n, other=NULL_PAGE)
        mapped = (j < n) & (pages != NULL_PAGE)
        holder = mapped & (tl.load(extremes + pages, mask=mapped, other=-2, volatile=True) == at)
        total += tl.sum(holder.to(tl.int64))
        tl.store(extremes + pages, REST, mask=holder)  # back at rest
        start += BLOCK
    tl.atomic_add(counts + at, total)


def frees_a_page(cache, table: torch.Tensor, held: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """blink.engine.core.page_sharing.frees_a_page's result, for the slots' tables and held counts."""
    S, width = table.shape
    assert table.stride(1) == 1 and table.stride(0) == width
    block = min(1024, triton.next_power_of_2(width))
    cache.epoch += 1  # marks of earlier calls are stale
    _mark[(S,)](held, table, kept, cache.mark, cache.epoch, WIDTH=width, BLOCK=block)
    out = torch.empty_like(kept)
    _frees[(S,)](held, table, cache.mark, cache.epoch, out, WIDTH=width, BLOCK=block)
    return out


def pages_by_position(cache, table: torch.Tensor, held: torch.Tensor, position: torch.Tensor,
                      reduce: str) -> torch.Tensor:
    """blink.engine.core.page_sharing.pages_by_position's result, for the slots' tables and held counts."""
    S, width = table.shape
    assert table.stride(1) == 1 and table.stride(0) == width
    last = reduce == "amax"
    block = min(1024, triton.next_power_of_2(width))
    extremes = cache.extremes[1 if last else 0]
    counts = torch.empty(S + 1, dtype=torch.int64, device=table.device)
    _extreme[(S,)](held, table, position, extremes, counts, S, WIDTH=width, LAST=last, BLOCK=block)
    _count[(S,)](held, table, position, extremes, counts, WIDTH=width, REST=AT_REST[reduce], BLOCK=block)
    return counts[:S]
