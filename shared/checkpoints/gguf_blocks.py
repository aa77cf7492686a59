"""GGUF's quantized blocks repacked, not dequantized: codes, one per byte, with a scale and an offset per 32 inputs.

Each 8-, 5- or 4-bit type is w = scale * code + offset over a group of 32 inputs of one output, codes unsigned:
Q8_0 (code = q + 128, offset = -128 * d), Q5_0 (offset = -16 * d) and Q5_1 (offset = its min), their 5-bit codes run
as 8-bit ones (no 5-bit kernel: exact, at a byte a weight), Q4_0 (offset = -8 * d), Q4_1 (offset = its min), Q4_K
(its 6-bit sub-block scales and mins times the super-block's d and dmin). Scales and offsets are float16, as the files
store them: exact for Q8_0, Q5_0, Q5_1, Q4_0 and Q4_1; Q4_K's products d * scale are rounded to float16 (relative
2^-11, well inside 4 bits' error).

Q6_K cannot take that form exactly: its int8 scales are per 16 inputs, and no code c with one float16 scale and
offset per 32 holds d * s * (q - 32) for two different s (nor does s * (q - 32), up to 4,096, fit 8 bits). It is kept
as it is stored, 6 bits: codes q (0..63, one a byte), `scale` its int8 sub-block scales [N, K / 16], `offset` its
super-block's float16 d [N, K / 256], w = d * s * (q - 32), exactly gguf's dequantization (d * s * (q - 32) needs at
most 24 bits of mantissa, so float32 holds it whole).
The engine lays these out for its CPU kernels (blink.engine.model.quant); other types have no repacking (None).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, Q6_K

GROUP = 32
SUB, SUPER = 16, 256  # Q6_K: inputs of a sub-block (an int8 scale) and of a super-block (a float16 d)
# Beside a converted GGUF's float shards (blink.shared.checkpoints.gguf_file): each repacked matrix as NAME.codes,
# NAME.scale, NAME.offset, and the metadata's BITS_KEY a JSON map of NAME to its codes' bits.
FILE = "quantized.safetensors"
BITS_KEY = "blink.bits"
# type -> bits of its codes
REPACKED = {GGMLQuantizationType.Q8_0: 8, GGMLQuantizationType.Q5_0: 8, GGMLQuantizationType.Q5_1: 8,
            GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q4_K: 4,
            GGMLQuantizationType.Q6_K: 6}


def repack(kind: GGMLQuantizationType, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """data: the tensor's bytes, [outputs, bytes of a row] as gguf's reader gives them. Returns codes uint8 [N, K],
    scale and offset float16 [N, K / 32] (Q6_K: int8 [N, K / 16] and float16 [N, K / 256]), and the codes' bits;
    None for a type without a repacking."""
    if kind not in REPACKED:
        return None
    rows = data.shape[0]
    if kind == GGMLQuantizationType.Q6_K:
        return _q6_k(data.reshape(-1, Q6_K.type_size), rows)
    if kind == GGMLQuantizationType.Q8_0:
        blocks = data.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes.reshape(rows, -1), d, (d * np.float16(-128)).astype(np.float16), 8
    if kind in (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1):
        return _q5(data, rows, minimum=kind == GGMLQuantizationType.Q5_1)
    if kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        head = 2 if kind == GGMLQuantizationType.Q4_0 else 4
        blocks = data.reshape(rows, -1, head + 16)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        offset = (d * np.float16(-8) if head == 2 else blocks[..., 2:4].copy().view(np.float16)[..., 0])
        qs = blocks[..., head:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # inputs 0-15 in the low nibbles, 16-31 in the high
        return codes.reshape(rows, -1), d, offset.astype(np.float16), 4
    blocks = data.reshape(-1, 144)  # Q4_K: 256 inputs a block, 8 groups of 32
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(rows, -1)
    scale = (d * sc.astype(np.float32)).astype(np.float16).reshape(rows, -1)
    offset = (-(dmin * mins.astype(np.float32))).astype(np.float16).reshape(rows, -1)
    return codes, scale, offset, 4


def _q5(data: np.ndarray, rows: int, minimum: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A Q5_0 block: float16 d, qh (32 high bits, input i's at bit i), qs[16] (inputs 0-15 in the low nibbles, 16-31
    in the high); Q5_1's has its float16 min after d."""
    head = 4 if minimum else 2
    blocks = data.reshape(rows, -1, head + 20)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    offset = blocks[..., 2:4].copy().view(np.float16)[..., 0] if minimum else (d * np.float16(-16)).astype(np.float16)
    high = blocks[..., head:head + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32) & 1
    qs = blocks[..., head + 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (high.astype(np.uint8) << 4)
    return codes.reshape(rows, -1), d, offset, 8


def _q6_k(blocks: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A Q6_K block: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], float16 d; the bit order is gguf's
    dequantize_blocks'."""
    ql, qh, scales, d = np.split(blocks, [128, 192, 208], axis=1)
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    codes = low.reshape(-1, 2, 4, 32) | (high.reshape(-1, 2, 4, 32) << 4)
    return (codes.reshape(rows, -1), scales.copy().view(np.int8).reshape(rows, -1),
            d.copy().view(np.float16).reshape(rows, -1), 6)


def dequantized(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The float32 weight a repacking stands for: scale * code + offset, group by group (Q6_K: d * s * (q - 32))."""
    rows, k = codes.shape
    if scale.dtype == np.int8:
        d = np.repeat(offset.astype(np.float32), SUPER // SUB, axis=1) * scale.astype(np.float32)
        return (d[..., None] * (codes.reshape(rows, k // SUB, SUB).astype(np.float32) - 32)).reshape(rows, k)
    grouped = codes.reshape(rows, k // GROUP, GROUP).astype(np.float32)
    return (grouped * scale.astype(np.float32)[..., None] + offset.astype(np.float32)[..., None]).reshape(rows, k)
