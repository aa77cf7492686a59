"""RoPE on q and k and the K/V cache write, as one Triton kernel over the batch's tokens.

The math is engine/rope.py's rotate-half form, rounded as torch rounds it: each product is cast to the model's
dtype before the sum, so 16-bit results match the reference bit for bit. The forward does this inside its
attention launch (engine/kernels/attention.py, `Rope`), with the same rounding; this kernel on its own is what
that launch is checked against (the same cache, bit for bit: tests/engine/test_kernels.py). Float8 caches
(`--kv-cache-dtype fp8`) take round(x / scale), as that launch writes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.kernels.tile_math import fp8_round_bits, to_fp8

TILE = 4096  # elements of q one program ropes, at least one token's worth


@triton.jit
def _rotate(src, stride_src, dst, stride_dst, cos1, cos2, sin1, sin2, token_ok, scale,
            HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
            FP8: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_BITS: tl.constexpr):
    """dst = rope(src) for the heads of a block of tokens: src, dst [T, 1, 1] pointers to each token's first head;
    cos/sin halves [T, 1, BLOCK_HALF] float32. FP8: dst is float8, given rope(src) / scale."""
    h = tl.arange(0, BLOCK_H)[None, :, None]
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    mask = token_ok & (h < HEADS) & (i < HALF)
    x1 = tl.load(src + h * stride_src + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * stride_src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    dtype = src.dtype.element_ty  # the model's: what the products round to
    y1 = ((x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    if FP8:
        y1 = to_fp8(y1, scale, dst.dtype.element_ty, FP8_MAX, ROUND_BITS)
        y2 = to_fp8(y2, scale, dst.dtype.element_ty, FP8_MAX, ROUND_BITS)
    tl.store(dst + h * stride_dst + i, y1, mask=mask)
    tl.store(dst + h * stride_dst + HALF + i, y2, mask=mask)


@triton.jit
def _rope_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, cos_ptr, sin_ptr, pos_ptr, write_ptr, k_cache_ptr, v_cache_ptr, tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_table,
    stride_kr, stride_kch, stride_vr, stride_vch, kv_scales,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_BITS: tl.constexpr,
):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None, None]  # [T, 1, 1]
    t_ok = t < tokens
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0)
    row = tl.load(write_ptr + t, mask=t_ok, other=0)  # flat cache row: page * page_size + offset (padding: row 0)
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    table = pos * stride_table + i
    cs_mask = t_ok & (i < HALF)
    cos1 = tl.load(cos_ptr + table, mask=cs_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=cs_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    k_scale, v_scale = 1.0, 1.0
    if FP8:
        k_scale, v_scale = tl.load(kv_scales), tl.load(kv_scales + 1)
    _rotate(q_ptr + t * stride_qt, stride_qh, q_out_ptr + t * stride_ot, stride_oh, cos1, cos2, sin1, sin2, t_ok,
            1.0, Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF, False, FP8_MAX, ROUND_BITS)
    _rotate(k_ptr + t * stride_kt, stride_kh, k_cache_ptr + row * stride_kr, stride_kch, cos1, cos2, sin1, sin2,
            t_ok, k_scale, KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF, FP8, FP8_MAX, ROUND_BITS)
    h = tl.arange(0, BLOCK_HKV)[None, :, None]
    d = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
    mask = t_ok & (h < KV_HEADS) & (d < 2 * HALF)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:
        v = to_fp8(v, v_scale, v_cache_ptr.dtype.element_ty, FP8_MAX, ROUND_BITS)
    tl.store(v_cache_ptr + row * stride_vr + h * stride_vch + d, v, mask=mask)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, write_rows: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Returns roped q [B, Hq, D] and writes roped k and v [B, Hkv, D] to the cache rows `write_rows` [B].
    kv_scales: float8 caches' K and V scales (float32 [2]; None: 1.0).

    cos, sin: tables [max_len, D] indexed by `positions` [B]; caches: one layer's [pages, page_size, Hkv, D].
    q, k and v may be strided views (of the fused qkv projection) as long as head_dim is contiguous.
    """
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert head_dim % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    if tokens == 0:
        return out
    fp8 = k_cache.element_size() == 1
    if fp8 and kv_scales is None:
        kv_scales = torch.ones(2, dtype=torch.float32, device=q.device)
    k_rows, v_rows = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    block_hq, block_half = triton.next_power_of_2(q_heads), triton.next_power_of_2(head_dim // 2)
    block_t = max(1, TILE // (block_hq * block_half))
    _rope_and_cache_kernel[(triton.cdiv(tokens, block_t),)](
        q, k, v, out, cos, sin, positions, write_rows, k_rows, v_rows, tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
        kv_scales if fp8 else q,
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=head_dim // 2,
        BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HKV=triton.next_power_of_2(kv_heads), BLOCK_HALF=block_half,
        FP8=fp8, FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0,
        ROUND_BITS=fp8_round_bits(k_cache.dtype) if fp8 and q.device.type == "cpu" else 0,
    )
    return out
