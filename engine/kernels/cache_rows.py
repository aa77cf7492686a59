"""Where each batch token's K/V goes in the page pool, in one launch: its page from the block table at its slot and
position, times the page size, plus its offset in the page (0 for padding) — engine/model/kernel_sets.py
`write_rows`, the torch reference, in five fewer kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256  # batch tokens a program places


@triton.jit
def _write_rows_kernel(token_slot, token_pos, token_valid, B, table, table_stride, page_size, out,
                       BLOCK: tl.constexpr):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = b < B
    slot = tl.load(token_slot + b, mask=inside, other=0)
    pos = tl.load(token_pos + b, mask=inside, other=0)
    page = tl.load(table + slot * table_stride + pos // page_size, mask=inside, other=0)
    valid = inside & (tl.load(token_valid + b, mask=inside, other=0) != 0)
    tl.store(out + b, tl.where(valid, page * page_size + pos % page_size, 0), mask=inside)


def write_rows(token_slot: torch.Tensor, token_pos: torch.Tensor, token_valid: torch.Tensor, table: torch.Tensor,
               page_size: int) -> torch.Tensor:
    """[B] the pool row of each batch token (the first B of the plan's token lists), 0 where it is padding."""
    B = token_slot.shape[0]
    out = torch.empty(B, dtype=torch.int64, device=token_slot.device)
    if B:
        _write_rows_kernel[(triton.cdiv(B, BLOCK),)](token_slot, token_pos, token_valid, B, table, table.stride(0),
                                                     page_size, out, BLOCK=BLOCK, num_warps=4)
    return out
