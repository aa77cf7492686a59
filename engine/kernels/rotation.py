"""KV rotation's page copies as device work, for the captured step: the step's plan lays out the moves on the
device (blink.engine.core.rotation.PageMoves, how many are real in its sizes), and one kernel per direction and
cache copies them between the page pool and the host mirror's pinned memory, which the device addresses directly.
The count is read on the device, so the launch's shape never depends on it: a fixed grid of programs strides over
the moves (a page of one layer each), and finds none to do in a step that moves nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PROGRAMS = 128  # enough to keep PCIe busy; each loops over the moves it owns
BLOCK = 1024


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, count_ptr, stride_src_page, stride_src_layer,
                       stride_dst_page, stride_dst_layer, LAYERS: tl.constexpr, PAGE_ELEMENTS: tl.constexpr,
                       PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
    items = tl.load(count_ptr) * LAYERS
    item = tl.program_id(0)
    while item < items:  # a while loop: Triton 3.6's interpreter cannot range() over a loaded bound
        # int64 offsets: layers of a pool pass 2**31 elements between them (an 8B model's from its sixth, on an H100).
        move, layer = item // LAYERS, (item % LAYERS).to(tl.int64)
        src = src_ptr + tl.load(src_ids_ptr + move).to(tl.int64) * stride_src_page + layer * stride_src_layer
        dst = dst_ptr + tl.load(dst_ids_ptr + move).to(tl.int64) * stride_dst_page + layer * stride_dst_layer
        for start in range(0, PAGE_ELEMENTS, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < PAGE_ELEMENTS
            tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)
        item += PROGRAMS


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
               count: torch.Tensor) -> None:
    """For i < count: dst[:, dst_ids[i]] = src[:, src_ids[i]], where src and dst are [layers, pages, ...] views
    (the pool's K or V, or the mirror's K or V half) whose page of one layer is contiguous."""
    layers, page_elements = src.shape[0], src[0, 0].numel()
    assert dst.shape[0] == layers and dst[0, 0].numel() == page_elements
    assert src[0, 0].is_contiguous() and dst[0, 0].is_contiguous()
    _copy_pages_kernel[(PROGRAMS,)](
        src, dst, src_ids, dst_ids, count, src.stride(1), src.stride(0), dst.stride(1), dst.stride(0),
        LAYERS=layers, PAGE_ELEMENTS=page_elements, PROGRAMS=PROGRAMS, BLOCK=BLOCK)
