"""FP8 products' Triton kernels (blink.engine.model.fp8): activations quantized to E4M3 in one launch, and the
product with a block-scaled weight (DeepSeek-V3's and Qwen3-FP8's 128x128 blocks).

`quantize`: each row's groups of inputs (the whole row: per token; 128: per token and block) scaled by amax / 448,
or by a static scale, in one launch where torch takes six (blink.engine.model.fp8.quantize_rows and
quantize_groups are its numbers in torch; Triton's interpreter may round an E4M3 code the other way).
`block_linear`: each program's tile of the output sums, block of inputs by block, the E4M3 tensor-core product
times both scales in float32 (fp8.reference_block_linear is its numbers in torch). Tile sizes are first choices,
not yet tuned on a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-12)  # fp8.MIN_AMAX: an all-zero group's scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_q, stride_s, K: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr):
    row, g = tl.program_id(0), tl.program_id(1)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    first = g * GROUP
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, GROUP, BLOCK):
            k = first + start + offs
            x = tl.load(x_row + k, mask=(k < K) & (start + offs < GROUP), other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), E4M3_MAX)  # IEEE's division, as torch's
    tl.store(s_ptr + row * stride_s + g, scale)
    for start in range(0, GROUP, BLOCK):
        k = first + start + offs
        mask = (k < K) & (start + offs < GROUP)
        x = tl.load(x_row + k, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -E4M3_MAX), E4M3_MAX)
        tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize(x: torch.Tensor, group: int | None = None,
             static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) in E4M3, and its float32 scales [M, groups]: one per row (group None) or per row
    and `group` inputs; static_scale: a float32 [] that every row uses instead of its own."""
    m, k = x.shape
    assert x.stride(1) == 1
    group = group or k
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(group), 4096)
        _quantize_kernel[(m, groups)](x, q, scale, scale if static_scale is None else static_scale, x.stride(0),
                                      q.stride(0), scale.stride(0), K=k, GROUP=group, BLOCK=block,
                                      STATIC=static_scale is not None, num_warps=4 if block <= 1024 else 8)
    return q, scale


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
    ceil(K/bk)]; block: (bn, bk), bk a power of two from 32 (engine/model/fp8.py runs smaller blocks dequantized).
    Returns [M, N] in out_dtype."""
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
