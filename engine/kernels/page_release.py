"""Prefix caching's page release as one Triton kernel: blink.engine.core.prefix_cache.PrefixCache.release (the torch
reference: references dropped, release stamps, the free count over the whole pool; about thirty small ops, a kernel
each in a captured step, every step) in one launch, a program per slot, and the release clock's tick. The free count
moves by the references that reach zero (atomics), not by a count over the pool.
tests/engine/test_page_release_kernel.py holds it to the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core import kv_cache

NULL_PAGE = tl.constexpr(kv_cache.NULL_PAGE)  # a kernel reads only constexpr globals


@triton.jit
def _release(which, table, held, refs, stamp, clock, num_free, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    if not tl.load(which + s):
        return
    n = tl.load(held + s)
    tick = tl.load(clock) + 1  # the clock's new value (the launcher advances it after)
    row = table + s.to(tl.int64) * WIDTH
    start = 0
    while start < n:  # a while loop: the interpreter cannot range() over a loaded value
        j = start + tl.arange(0, BLOCK)
        give = j < n
        pages = tl.load(row + j, mask=give, other=NULL_PAGE)
        before = tl.atomic_add(refs + pages, -1, mask=give)
        # Later pages of a request count as released earlier: evicted first, they leave its prefix cached longest.
        tl.store(stamp + pages, tick * WIDTH + (WIDTH - 1 - j), mask=give)
        tl.atomic_add(num_free, tl.sum((give & (before == 1)).to(tl.int64)))
        tl.store(row + j, NULL_PAGE, mask=give)
        start += BLOCK
    tl.store(held + s, 0)


def release(cache, which: torch.Tensor, table: torch.Tensor, held: torch.Tensor) -> None:
    """PrefixCache.release's arguments and effects (`cache`: the PrefixCache), but for the null page's stamp, which
    the reference writes for nothing and no one reads."""
    width = table.shape[1]
    assert table.stride(1) == 1 and table.stride(0) == width
    _release[(which.shape[0],)](which, table, held, cache.refs, cache.stamp, cache.clock, cache.num_free, WIDTH=width,
                                BLOCK=min(1024, triton.next_power_of_2(width)))
    cache.clock += 1
