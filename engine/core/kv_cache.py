"""The paged KV cache: one preallocated pool of pages and a free-page stack that lives on the device.

Page 0 is the null page: it is never handed out, block-table entries that point nowhere point at it,
and padding tokens write their K/V there. Allocation and release are fixed-shape tensor work (masked
scatters and prefix sums), so they run inside the step with no host sync.

Pages are stored in the model's dtype or, with `--kv-cache-dtype fp8`, in float8 with a K and a V scale per layer
(`scales`: blink.engine.core.kv_dtype), at half the bytes a page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from blink.engine.model import huge_pages
from blink.engine.model.config import ModelConfig

if TYPE_CHECKING:
    from blink.engine.core.prefix_cache import PrefixCache

NULL_PAGE = 0


class FreeList:
    """A stack of free page ids on the device: entries [0, num_free) are free; page 0 is never among them."""

    def __init__(self, num_pages: int, device: torch.device):
        self.num_pages = num_pages
        # One cell more than ever holds a free page: it takes masked-off writes.
        self.stack = torch.zeros(num_pages, dtype=torch.int64, device=device)
        self.stack[: num_pages - 1] = torch.arange(num_pages - 1, 0, -1, device=device)
        self.num_free = torch.tensor(num_pages - 1, dtype=torch.int64, device=device)

    def allocate(self, need: torch.Tensor, table: torch.Tensor, held: torch.Tensor, max_new: int) -> None:
        """Gives slot s `need[s]` more pages (at most max_new) after its `held[s]`; the caller guarantees they
        are free. The table's last column is a trash column that takes the masked-off writes."""
        j = torch.arange(max_new, device=need.device)
        grant = j[None, :] < need[:, None]  # [S, max_new]
        rank = grant.flatten().cumsum(0).view_as(grant) - 1  # order in which pages leave the stack
        pages = self.stack[(self.num_free - 1 - rank).clamp(min=0)]
        col = torch.where(grant, held[:, None] + j[None, :], table.shape[1] - 1)
        table.scatter_(1, col, pages)
        held += need
        self.num_free -= need.sum()

    def release(self, which: torch.Tensor, table: torch.Tensor, held: torch.Tensor) -> None:
        """Returns every page held by the slots in the mask `which` to the stack."""
        j = torch.arange(table.shape[1], device=which.device)
        give = (which[:, None] & (j[None, :] < held[:, None])).flatten()
        pos = torch.where(give, self.num_free + give.cumsum(0) - 1, self.num_pages - 1)
        self.stack.scatter_(0, pos, table.flatten())
        self.num_free += give.sum()
        table.masked_fill_(give.view_as(table), NULL_PAGE)
        held.masked_fill_(which, 0)


class PagePool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, device: torch.device,
                 prefix_cache: PrefixCache | None = None, kv_dtype: torch.dtype | None = None,
                 scales: torch.Tensor | None = None):
        """prefix_cache: the pages' allocator with prefix caching (its pages shared and kept); else a FreeList.
        kv_dtype: what pages are stored in (None: the model's dtype); scales: float8 pages' [layers, 2] K and V
        scales (None: 1.0)."""
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed so padding tokens that read never-written rows still see finite values; on the CPU in huge pages, as
        # decode attention streams them (blink.engine.model.huge_pages).
        self.dtype = kv_dtype or cfg.dtype
        self.k = huge_pages.zeros(shape, self.dtype, device)
        self.v = huge_pages.zeros(shape, self.dtype, device)
        self.page_bytes = self.k[:, 0].nbytes * 2  # a page's K and V over all layers
        self.scales = None  # the model's dtype: no scales
        if self.dtype.itemsize == 1:
            ones = torch.ones(cfg.num_layers, 2, dtype=torch.float32)
            self.scales = (ones if scales is None else scales.float()).to(device).contiguous()
            if self.scales.shape != (cfg.num_layers, 2):
                raise ValueError(f"KV scales must be [layers, 2] = [{cfg.num_layers}, 2], got {list(scales.shape)}")
        self.prefix_cache = prefix_cache
        self.free = prefix_cache or FreeList(num_pages, device)

    @property
    def num_free(self) -> torch.Tensor:
        return self.free.num_free

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, kv_dtype: torch.dtype | None = None) -> int:
        """A page's K and V over all layers, in kv_dtype (None: the model's dtype)."""
        return 2 * cfg.num_layers * page_size * cfg.kv_size * (kv_dtype or cfg.dtype).itemsize

    @property
    def fp8(self) -> bool:
        return self.scales is not None

    def allocate(self, need: torch.Tensor, block_table: torch.Tensor, pages_held: torch.Tensor,
                 max_new: int) -> None:
        self.free.allocate(need, block_table, pages_held, max_new)

    def release(self, which: torch.Tensor, block_table: torch.Tensor, pages_held: torch.Tensor) -> None:
        self.free.release(which, block_table, pages_held)
