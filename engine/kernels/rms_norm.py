"""RMSNorm as a Triton kernel, rounded as engine/model.py's `rms_norm` rounds (normalise in float32, cast to x's
dtype, then scale by the weight), and a variant that first adds a sublayer's output to the residual stream: one
pass over the row instead of an add and a norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements one program normalises, at least one row


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, sum_ptr, w_ptr, out_ptr, rows, stride_x, stride_delta, stride_sum, stride_out,
                     eps, N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (cols < N)
    x = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0)
    if ADD:  # x + delta, rounded to x's dtype as torch's add is, is both the new residual and the norm's input
        delta = tl.load(delta_ptr + r * stride_delta + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + r * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 1) / N + eps)[:, None]
    normed = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous()
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = torch.empty_like(rows) if delta is not None else rows
    deltas = delta.reshape(-1, n) if delta is not None else rows
    assert rows.stride(-1) == deltas.stride(-1) == 1
    block = triton.next_power_of_2(n)
    block_r = max(1, TILE // block)
    if rows.shape[0]:
        _rms_norm_kernel[(triton.cdiv(rows.shape[0], block_r),)](
            rows, deltas, total, weight, out, rows.shape[0], rows.stride(0), deltas.stride(0), total.stride(0),
            out.stride(0), eps, N=n, BLOCK_R=block_r, BLOCK=block, ADD=delta is not None,
            num_warps=min(16, max(1, block_r * block // 256)))
    return total.view(x.shape), out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] (N contiguous); weight: [N]."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (x + delta, rms_norm(x + delta)): the residual stream and the next sublayer's input."""
    assert delta.shape == x.shape and delta.dtype == x.dtype
    return _launch(x, delta, weight, eps)
