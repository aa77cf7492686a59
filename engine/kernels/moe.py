"""The experts of a mixture-of-experts layer as one grouped product per projection, over a fixed-size buffer of the
tokens' copies sorted by expert (blink.engine.model.moe.sort_by_expert): each block of BLOCK_M rows belongs to one
expert, named by `block_expert` (-1: an unused block, skipped). No host read and no shape that depends on the
routing, so the captured step holds it; the work grows with the routed tokens, not with experts × tokens.

Rounded as the torch path is: each projection's output to the model's dtype, then SiLU, then the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.kernels.tile_math import dot

BLOCK_M = 16  # rows per block: the routing pads each expert's rows to a multiple of it
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _expert_product_kernel(x_ptr, row_ptr, expert_ptr, w_ptr, out_ptr, stride_x, stride_we, stride_wn, stride_out,
                           N: tl.constexpr, K: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[rows, n] = x[rows] @ w[e, n].T for the block's expert e; GATHER: row i reads x[row[i]] (the token it
    copies); GATED: w holds [gate; up] (2N rows) and out = silu(x @ gate.T) * (x @ up.T)."""
    block = tl.program_id(0)
    e = tl.load(expert_ptr + block)
    if e >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        source = tl.load(row_ptr + rows) if GATHER else rows
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + source[:, None].to(tl.int64) * stride_x + k[None, :], mask=k[None, :] < K, other=0.0)
            w_mask = (k[:, None] < K) & (n[None, :] < N)
            acc += dot(x, tl.load(w + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0), PRECISION,
                        UPCAST)
            if GATED:
                acc_up += dot(x, tl.load(w + (N + n[None, :]) * stride_wn + k[:, None], mask=w_mask, other=0.0),
                               PRECISION, UPCAST)
        dtype = out_ptr.dtype.element_ty
        if GATED:
            gate, up = acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32)
            acc = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + n[None, :], acc.to(dtype), mask=n[None, :] < N)


def expert_products(h: torch.Tensor, token: torch.Tensor, block_expert: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """h: [T, hidden]; token: [rows] the token each row copies; block_expert: [rows // BLOCK_M]; gate_up: [experts,
    2 * inter, hidden]; down: [experts, hidden, inter]. Returns [rows, hidden]: each row's expert's MLP of its
    token (rows of unused blocks are left unwritten)."""
    rows, (hidden, inter) = token.shape[0], down.shape[1:]
    assert rows % BLOCK_M == 0 and block_expert.shape[0] == rows // BLOCK_M
    assert h.stride(-1) == gate_up.stride(-1) == down.stride(-1) == 1
    act = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    out = torch.empty(rows, hidden, dtype=h.dtype, device=h.device)
    options = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                   PRECISION="tf32x3" if h.dtype == torch.float32 else "tf32",
                   UPCAST=h.dtype == torch.bfloat16 and h.device.type == "cpu")  # as in the attention kernel
    blocks = rows // BLOCK_M
    _expert_product_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        h, token, block_expert, gate_up, act, h.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        inter, hidden, GATHER=True, GATED=True, **options)
    _expert_product_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        act, token, block_expert, down, out, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        hidden, inter, GATHER=False, GATED=False, **options)
    return out
