"""Quantized projection weights on the CPU: 8- and 4-bit codes with scales, quantized on load or as a GGUF stores them.

A weight is `Quantized`: codes (unsigned, one per byte) and w = scale * code + offset, per output and group of 32
inputs (`GROUPED`: float16 scales, as GGUF's blocks; blink.shared.checkpoints.gguf_blocks repacks them) or per output
(float32). `--quantization` says where they come from: `int8` quantizes each float weight on load, symmetric, a scale
per output channel; `int4` in groups of 32, symmetric (llama.cpp's Q4_0 rule), the output projection in int8 (`OUTPUT`);
`gguf` runs a GGUF file's own Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks, repacked once when the file was converted, and
its matrices in other types (Q5_x, float) in int8, quantized from their dequantized values. Q6_K keeps its own form
(`bits` 6): codes 0..63, `scale` its int8 scales per 16 inputs, `offset` its float16 d per 256, w = d * s * (code -
32), exactly as gguf dequantizes it (blink.shared.checkpoints.gguf_blocks says why no 32-input form holds it).

Products: `lay_out` puts a weight in the AVX-512 VNNI kernel's form (engine/kernels/quant_linear.cpp: blocks of 64
outputs, activations quantized per row to int8 by groups of 32 on the fly). Where that kernel cannot run (no VNNI, or
shapes it does not take), `reference_linear` computes the same numbers with torch, slowly. The torch reference is
also what the kernel is tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from blink.engine.model import huge_pages
from blink.shared.quantization import QUANTIZATIONS as METHODS  # --quantization's values (vLLM's flag)

# The output projection in more bits than the layers, as llama.cpp's quantizer keeps it (Q6_K under 4-bit types).
OUTPUT = {"int4": "int8"}
GROUP = 32  # inputs sharing an activation scale (and a weight scale, grouped)
SUB, SUPER = 16, 256  # 6 bits (Q6_K): inputs of an int8 sub-block scale, of a float16 super-block scale
BLOCK = 64  # outputs of a block of the kernel's layout


@dataclass
class Quantized:
    """codes: uint8 [N, K]; scale, offset: float16 [N, K / 32] (grouped) or float32 [N, 1] (per output); 6 bits:
    scale int8 [N, K / 16], offset float16 [N, K / 256] (Q6_K's s and d)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def grouped(self) -> bool:
        return self.scale.dtype == torch.float16

    def to(self, device: torch.device | str) -> Quantized:
        return Quantized(self.codes.to(device), self.scale.to(device), self.offset.to(device), self.bits)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.codes.shape
        if self.bits == 6:
            codes = self.codes.view(n, k // SUB, SUB).float() - 32
            return (codes * self.sub_scales()[..., None]).view(n, k).to(dtype)
        groups = self.scale.shape[1]
        codes = self.codes.view(n, groups, k // groups).float()
        return (codes * self.scale.float()[..., None] + self.offset.float()[..., None]).view(n, k).to(dtype)


    def sub_scales(self) -> torch.Tensor:
        """6 bits: d * s per 16 inputs, float32 [N, K / 16] (exact: an 11-bit d times an 8-bit s)."""
        return self.offset.float().repeat_interleave(SUPER // SUB, dim=1) * self.scale.float()


def cat(parts: list[torch.Tensor] | list[Quantized]) -> torch.Tensor | Quantized:
    """Projections fused by their outputs (q, k, v; gate, up): quantized ones when all are, with the same form."""
    if not any(isinstance(p, Quantized) for p in parts):
        return torch.cat(parts)
    if not all(isinstance(p, Quantized) for p in parts) or len({(p.bits, p.grouped) for p in parts}) > 1:
        # a GGUF may store q, k and v in different types (or one in a type without a repacking): the fused weight
        # is then quantized again, int8 per output, from what each part stands for
        parts = [quantize(p.dequantize() if isinstance(p, Quantized) else p, "int8") for p in parts]
    return Quantized(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "offset")), parts[0].bits)


def quantize(weight: torch.Tensor, method: str) -> Quantized:
    """A float weight [N, K] as `method` (int8 per output channel; int4 in groups of 32) quantizes it."""
    w = weight.float()
    if method == "int8":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        codes = torch.round(w / torch.where(scale > 0, scale, 1)).clamp(-127, 127) + 128
        return Quantized(codes.to(torch.uint8), scale, scale * -128, 8)
    if method == "int4":  # Q4_0's rule: the group's value of largest magnitude maps to -8
        n, k = w.shape
        groups = w.view(n, k // GROUP, GROUP)
        extreme = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True))[..., 0]
        d = extreme / -8
        inv = torch.where(d != 0, 1 / d, 0)
        codes = (groups * inv[..., None] + 8.5).floor().clamp(0, 15)
        return Quantized(codes.view(n, k).to(torch.uint8), d.half(), (d.half() * -8), 4)
    raise ValueError(f"quantization must be one of {', '.join(m for m in METHODS if m != 'gguf')} to quantize on "
                     f"load, got {method!r}")


def check(method: str | None, device: torch.device, load_format: str, tensor_parallel_size: int) -> None:
    """Raises ValueError, saying why, where `--quantization method` cannot run."""
    if method is None:
        return
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if device.type != "cpu":
        raise ValueError(f"--quantization {method} runs on the CPU only (AVX-512 VNNI products); on {device.type} "
                         "Blink runs float32, bfloat16 or float16 weights")
    if method == "gguf" and load_format == "dummy":
        raise ValueError("--quantization gguf runs a GGUF file's blocks; --load-format dummy has none")
    if method == "gguf" and tensor_parallel_size > 1:
        raise ValueError("--quantization gguf does not split over tensor-parallel ranks yet; int8 and int4 do")


def takes(weight: torch.Tensor | Quantized) -> bool:
    """Whether a weight of this shape can be quantized (its inputs whole groups)."""
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0


@functools.cache
def kernel_ops():
    """torch.ops.blink_cpu where its VNNI projections run on this CPU, else None."""
    from blink.engine.kernels import cpu

    try:
        ops = cpu.ops()
    except cpu.Unavailable:
        return None
    return ops if ops.quant_linear_ready() else None


@dataclass
class LaidOut:
    """A `Quantized` weight in the kernel's layout (quant_linear.cpp's header): codes [N/64, K/4 or K/8, 64, 4]."""

    codes: torch.Tensor
    d: torch.Tensor
    b: torch.Tensor
    bits: int
    shape: torch.Size


def lay_out(q: Quantized) -> LaidOut | Quantized:
    """The kernel's form where it runs here, else the weight as it is (the torch reference runs it)."""
    n, k = q.shape
    if kernel_ops() is None or q.codes.device.type != "cpu" or n % BLOCK or k % (SUPER if q.bits == 6 else GROUP):
        return q
    step = 8 if q.bits == 4 else 4  # inputs a byte row of 4 codes covers (6-bit codes: a byte each)
    codes = q.codes.view(n // BLOCK, BLOCK, k // step, step)
    if q.bits == 4:  # the low nibble the even step of 4 inputs, the high nibble the odd one
        codes = codes[..., :4] | (codes[..., 4:] << 4)
    codes = codes.transpose(1, 2)
    laid = huge_pages.empty(codes.shape, torch.uint8).copy_(codes)
    if q.bits == 6:  # s [N/64, K/16, 64] int8, d [N/64, K/256, 64] float32
        d = q.scale.view(n // BLOCK, BLOCK, k // SUB).transpose(1, 2).contiguous()
        b = q.offset.float().view(n // BLOCK, BLOCK, k // SUPER).transpose(1, 2).contiguous()
    elif q.grouped:
        d, b = (t.view(n // BLOCK, BLOCK, k // GROUP).transpose(1, 2).contiguous() for t in (q.scale, q.offset))
    else:
        d, b = q.scale.reshape(n).contiguous(), q.offset.reshape(n).contiguous()
    return LaidOut(laid, d, b, q.bits, q.shape)


def linear(x: torch.Tensor, weight: LaidOut | Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, LaidOut):
        return kernel_ops().quant_linear(x, weight.codes, weight.d, weight.b, weight.bits, bias)
    return reference_linear(x, weight, bias)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernel quantizes it: int8 values (in float32) [M, K/32, 32], dx = amax / 127 and dx * their
    sum [M, K/32]."""
    m, k = x.shape
    groups = x.float().view(m, k // GROUP, GROUP)
    amax = groups.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127 / amax, 0)
    xq = torch.round(groups * inv[..., None])
    dx = amax / 127
    return xq, dx, dx * xq.sum(dim=2)


def reference_linear(x: torch.Tensor, q: Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's numbers in torch: sum over groups of dx * (d * I + b * S), I the integer dot products."""
    xq, dx, xs = quantize_activations(x)
    n, k = q.shape
    if q.bits == 6:  # per 16 inputs: integer dots of (code - 32), times d * s and the group's dx
        m = x.shape[0]
        dots = torch.einsum("msi,nsi->mns", xq.view(m, k // SUB, SUB), q.codes.view(n, k // SUB, SUB).float() - 32)
        out = (dots * q.sub_scales()[None] * dx.repeat_interleave(2, dim=1)[:, None, :]).sum(dim=2)
        return (out if bias is None else out + bias.float()).to(x.dtype)
    codes = q.codes.view(n, k // GROUP, GROUP).float()
    dots = torch.einsum("mgi,ngi->mng", xq, codes)  # integers, exact in float32 (|I| < 2^24)
    if q.grouped:
        out = (dots * q.scale.float()[None] * dx[:, None, :] + q.offset.float()[None] * xs[:, None, :]).sum(dim=2)
    else:
        out = (dots * dx[:, None, :]).sum(dim=2) * q.scale[:, 0] + xs.sum(dim=1, keepdim=True) * q.offset[:, 0]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
