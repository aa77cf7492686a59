"""Who maps which KV page, for the scheduler's `_make_room`. With prefix caching slots share pages, and a page frees
only when every slot mapping it gives it back: what giving back frees is counted per page, not per slot. Like the
scheduler, tensor work only: no read back to the host. Where the cache has its kernels (the device step's), each
function is a launch or two of blink.engine.kernels.page_sharing, with no pass over the pool, and `held_pages` builds
no mask."""

from __future__ import annotations

import torch

from blink.engine.core.kv_cache import NULL_PAGE, PagePool
from blink.engine.core.state import Slots


def held_pages(state: Slots, pool: PagePool) -> torch.Tensor | None:
    """[S, P] each slot's block-table entries in use, with prefix caching; None without (no page is shared)."""
    if pool.prefix_cache is None:
        return None
    if pool.prefix_cache.kernels is not None:
        return state.pages_held  # the kernels read each slot's count
    table = state.block_table
    return torch.arange(table.shape[1], device=table.device)[None, :] < state.pages_held[:, None]


def frees_a_page(state: Slots, pool: PagePool, held: torch.Tensor | None, kept: torch.Tensor) -> torch.Tensor:
    """[S] whether a slot holds a page that no slot in `kept` maps: giving its pages back could free one. held:
    `held_pages`'s."""
    if held is None:  # no page is shared
        return state.pages_held > 0
    if pool.prefix_cache.kernels is not None:
        return pool.prefix_cache.kernels.frees_a_page(pool.prefix_cache, state.block_table, state.pages_held, kept)
    table = state.block_table
    kept_page = torch.zeros(pool.num_pages, dtype=torch.bool, device=table.device)
    # index_fill_ and fill_, not item assignment: a Python scalar assigned is copied from the host, which no captured
    # step may do (the H200's graph capture failed on it).
    kept_page.index_fill_(0, torch.where(held & kept[:, None], table, NULL_PAGE).flatten(), True)
    kept_page.narrow(0, NULL_PAGE, 1).fill_(False)
    return (held & ~kept_page[table]).any(1)


def positions(order: torch.Tensor) -> torch.Tensor:
    """[S] each slot's position in `order` (a permutation of the slots)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))


def pages_by_position(state: Slots, pool: PagePool, held: torch.Tensor | None, position: torch.Tensor,
                      reduce: str) -> torch.Tensor:
    """[S] how many pages have their first ('amin') or last ('amax') mapping slot at each position (slot s at
    `position[s]`, in [0, S]; S counts nowhere). held: `held_pages`'s."""
    S, table = state.num_slots, state.block_table
    cache = pool.prefix_cache
    if held is not None and cache.kernels is not None:
        return cache.kernels.pages_by_position(cache, table, state.pages_held, position, reduce)
    counts = torch.zeros(S + 1, dtype=torch.int64, device=table.device)
    if held is None:  # no page is shared: a page's only holder is the slot whose pages_held counts it
        return counts.scatter_add_(0, position, state.pages_held)[:S]
    pages = torch.where(held, table, NULL_PAGE).flatten()
    start = S if reduce == "amin" else -1
    by_page = torch.full((pool.num_pages,), start, dtype=torch.int64, device=table.device)
    by_page.scatter_reduce_(0, pages, torch.where(held, position[:, None], start).flatten(), reduce=reduce)
    by_page = torch.where(by_page < 0, S, by_page)  # mapped by no slot
    by_page.narrow(0, NULL_PAGE, 1).fill_(S)  # not item assignment: a host copy (frees_a_page says why)
    return counts.scatter_add_(0, by_page, torch.ones_like(by_page))[:S]
