"""The gated MLP's activation, silu(gate) * up, as one Triton kernel over its fused projection's output, rounded as
engine/model/kernel_sets.py's `silu_and_mul` rounds (silu in float32, cast to the dtype, then the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements of the output one program writes


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, rows, stride_x, stride_out, N: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (r < rows) & (cols < N)
    gate = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + r * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + r * stride_out + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [B, 2 * N] (gate, then up), rows with a contiguous last dimension. Returns [B, N]."""
    rows, width = gate_up.shape
    n = width // 2
    assert width == 2 * n and gate_up.stride(-1) == 1
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(triton.next_power_of_2(n), TILE)
        block_r = max(1, TILE // block)
        _silu_and_mul_kernel[(triton.cdiv(rows, block_r), triton.cdiv(n, block))](
            gate_up, out, rows, gate_up.stride(0), out.stride(0), N=n, BLOCK_R=block_r, BLOCK=block,
            num_warps=min(8, max(1, block_r * block // 512)))
    return out
