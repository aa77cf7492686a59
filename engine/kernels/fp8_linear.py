"""The product of activations and a block-scaled FP8 weight (DeepSeek-V3's and Qwen3-FP8's 128x128 blocks) as one
Triton kernel: activations in E4M3 with a scale per token and input block, the weight's codes with a scale per
block; each program's tile of the output sums, block of inputs by block, the E4M3 tensor-core product times both
scales in float32 (blink.engine.model.fp8.reference_block_linear is its numbers in torch). Tile sizes are first
choices, not yet tuned on a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, stride_x, stride_xs, stride_w, stride_ws,
                      stride_out, K: tl.constexpr, GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one input block of the weight's scales a step
        g = k0 // BLOCK_K
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_w + k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        x_scale = tl.load(xs_ptr + rows * stride_xs + g, mask=row_ok, other=0.0)
        w_scale = tl.load(ws_ptr + (cols // GROUP_N) * stride_ws + g, mask=col_ok, other=0.0)
        acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def block_linear(xq: torch.Tensor, xs: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """xq: E4M3 [M, K] with xs: float32 [M, ceil(K/bk)]; codes: E4M3 [N, K] with scale: float32 [ceil(N/bn),
    ceil(K/bk)]; block: (bn, bk), bk a power of two from 16. Returns [M, N] in out_dtype."""
    m, k = xq.shape
    n = codes.shape[0]
    assert xq.stride(1) == 1 and codes.stride(1) == 1 and xs.stride(1) == 1 and scale.stride(1) == 1
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m:
        # 16 rows is the tensor cores' least: a decode's few rows waste some of the tile, never the weight's reads
        block_m = 16 if m <= 16 else 64
        block_n = 128 if m > 64 else 64
        _block_fp8_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            xq, xs, codes, scale, out, m, n, xq.stride(0), xs.stride(0), codes.stride(0), scale.stride(0),
            out.stride(0), K=k, GROUP_N=block[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block[1], num_warps=4)
    return out
