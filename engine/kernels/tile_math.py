"""Tile arithmetic Triton kernels share: a product the interpreter gets right, float8 rounding, RoPE of a tile.

`dot` is tl.dot with bfloat16 tiles upcast under Triton 3.6's interpreter (the CPU), which multiplies them as
integers. `to_fp8` / `from_fp8` are how a float8 KV cache (`--kv-cache-dtype fp8`) stores and reads a value: the
attention launch and the standalone RoPE + cache write round the same way, so a key is the same whichever wrote it.
`roped` is RoPE as engine/kernels/rope_kv.py rounds it, for the attention launch that ropes its own keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton 3.6's interpreter multiplies bfloat16 tiles as integers; their float32 products are exact
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def to_fp8(x, scale, DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_BITS: tl.constexpr):
    """x / scale in float8 (DTYPE), saturated at its largest finite value. ROUND_BITS > 0 (the interpreter): rounded
    to nearest-even in float32 first, dropping that many mantissa bits, as Triton 3.6's interpreter does not carry a
    rounding into the exponent (1.97 -> 1.0 in E4M3); the float8 conversion of the rounded value is then exact."""
    y = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)  # IEEE's division, as torch's
    if ROUND_BITS > 0:
        bits = y.to(tl.int32, bitcast=True)
        bits += (1 << (ROUND_BITS - 1)) - 1 + ((bits >> ROUND_BITS) & 1)
        y = (bits & -(1 << ROUND_BITS)).to(tl.float32, bitcast=True)
        y = tl.clamp(y, -FP8_MAX, FP8_MAX)
    return y.to(DTYPE)


@triton.jit
def from_fp8(x, scale, dtype: tl.constexpr):
    return (x.to(tl.float32) * scale).to(dtype)


@triton.jit
def roped(at, d, pos, mask, cos_ptr, sin_ptr, stride_cos, HALF: tl.constexpr):
    """RoPE (rotate-half) of a tile of head vectors: `at` [rows, 1] points at each row's head, d [1, D] the
    elements, pos [rows, 1] each row's position. Rounded as engine/kernels/rope_kv.py rounds (each product cast to
    the dtype before the sum), so a key roped here equals the one that kernel writes to the cache."""
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    x = tl.load(at + d, mask=mask, other=0.0)
    dtype = x.dtype
    y = tl.load(at + partner, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
    turned = (y * s).to(dtype).to(tl.float32)
    return ((x.to(tl.float32) * c).to(dtype).to(tl.float32) + tl.where(d < HALF, -turned, turned)).to(dtype)


def fp8_round_bits(dtype: torch.dtype) -> int:
    """The float32 mantissa bits a float8 dtype drops (23 less its own): what `to_fp8` rounds away itself in the
    interpreter."""
    return 23 - {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
