"""KV rotation: whole requests' pages move to a host-memory mirror of the page pool and back.

The step decides on the device which requests rotate out (best-effort and longest-running first, when the pool
runs short) and which come back (when pages free), allocates pages on both sides and lays out the page moves;
the mirror then copies them. On CUDA the mirror is pinned: the pages leaving are gathered on the compute stream
before the step can overwrite them and copied out on one stream while the pages coming back are copied in on
another, both overlapped with the step's forward; the copied-in pages are scattered into the pool after it, on
the compute stream, before the next step reads them. On the CPU the same moves are plain copies. A draft model's
KV (engine/core/draft_model.py) lives in pages of the same ids, and moves with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blink.engine.core.kv_cache import FreeList, PagePool

NEARLY_FULL = 0.9  # new requests are held back while the mirror is fuller than this


@dataclass
class PageMoves:
    """Page ids to copy, packed first; how many are real is in `StepPlan.sizes` (the host reads it)."""

    out_src: torch.Tensor  # pool pages leaving
    out_dst: torch.Tensor  # their mirror pages
    in_src: torch.Tensor  # mirror pages coming back
    in_dst: torch.Tensor  # their pool pages


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.is_floating_point() and cache.element_size() == 1 else cache


class HostMirror:
    def __init__(self, pool: PagePool, num_pages: int, draft: tuple[torch.Tensor, torch.Tensor] | None = None):
        """draft: a draft model's K and V caches, whose pages move with the pool's."""
        if num_pages < 2:
            raise ValueError(f"the host KV mirror needs at least 2 pages (one is never used), got {num_pages}")
        self.pool, self.num_pages = pool, num_pages
        self.device = device = pool.k.device
        self.free = FreeList(num_pages, device)  # on the engine's device: the step allocates from it
        self.pages_moved = torch.zeros(2, dtype=torch.int64, device=device)  # out, in: totals since the start
        self.hold_below = max(1, round((num_pages - 1) * (1 - NEARLY_FULL)))
        self.on_cuda = device.type == "cuda"
        # FP8 pages move as their bytes: a move copies, and CUDA's gathers and scatters take bytes of any build.
        self.caches = [(_bytes(k), _bytes(v)) for k, v in [(pool.k, pool.v), *([draft] if draft is not None else [])]]
        # For each cache, one contiguous block per page (its K and V over all layers): one copy per page moved.
        self.data = [torch.empty((num_pages, 2, *k.shape[:1], *k.shape[2:]), dtype=k.dtype, pin_memory=self.on_cuda)
                     for k, _ in self.caches]
        if self.on_cuda:
            self.out_stream, self.in_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self._landing: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def nearly_full(self) -> torch.Tensor:
        return self.free.num_free < self.hold_below

    def begin(self, moves: PageMoves, n_out: int, n_in: int) -> None:
        """Starts this step's copies; call before the step's forward, which may reuse the pages leaving."""
        if n_out:
            self._copy_out(moves.out_src[:n_out], moves.out_dst[:n_out].tolist())
        if n_in:
            self._copy_in(moves.in_src[:n_in].tolist(), moves.in_dst[:n_in])

    def end(self) -> None:
        """Puts the pages that came back into the pool; call after the step's forward is enqueued."""
        if self._landing is None:
            return
        pages, dst = self._landing
        self._landing = None
        torch.cuda.current_stream(self.device).wait_stream(self.in_stream)
        self._scatter(pages, dst)

    def _copy_out(self, src: torch.Tensor, dst: list[int]) -> None:
        for (k, v), data in zip(self.caches, self.data, strict=True):
            pages = torch.stack((k[:, src], v[:, src])).transpose(0, 2).transpose(1, 2)  # [n, 2, L, ...]
            if not self.on_cuda:
                data[dst] = pages
                continue
            pages = pages.contiguous()  # gathered on the compute stream, before the step writes these pages
            self.out_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.out_stream):
                for i, page in enumerate(dst):
                    data[page].copy_(pages[i], non_blocking=True)
            pages.record_stream(self.out_stream)

    def _copy_in(self, src: list[int], dst: torch.Tensor) -> None:
        if not self.on_cuda:
            self._scatter([data[src] for data in self.data], dst)
            return
        self.in_stream.wait_stream(self.out_stream)  # a page may come back right after it left
        self.in_stream.wait_stream(torch.cuda.current_stream(self.device))  # and the buffers are the compute stream's
        landing = [torch.empty((len(src), *data.shape[1:]), dtype=data.dtype, device=self.device)
                   for data in self.data]
        with torch.cuda.stream(self.in_stream):
            for pages, data in zip(landing, self.data, strict=True):
                for i, page in enumerate(src):
                    pages[i].copy_(data[page], non_blocking=True)
        self._landing = (landing, dst)

    def _scatter(self, landing: list[torch.Tensor], dst: torch.Tensor) -> None:
        for (k, v), pages in zip(self.caches, landing, strict=True):
            k[:, dst] = pages[:, 0].transpose(0, 1)
            v[:, dst] = pages[:, 1].transpose(0, 1)
