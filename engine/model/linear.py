"""The model's projections (x @ W.T), and how the CPU runs them at full bandwidth.

Measured on this project's 2-core VMs, all the projections of a token of a 125M Llama:

- On a CPU with AVX-512 (AVX512-BF16 for bfloat16): Blink's own kernel (`blocked_linear`,
  engine/kernels/blocked_linear.cpp) on the weight laid out once in blocks of 64 outputs (`block`), instead of
  oneDNN's packed layout. On the EPYC, side by side: bfloat16 1 row 10.9 -> 5.3 ms (the weights read at about the
  speed of a plain read, oneDNN at half of it), 16 rows 17.2 -> 12.2; float32 1 row 19.1 -> 10.1, 16 rows 32.6 ->
  25.2. A 512-token prefill runs at 0.8-1.1x oneDNN's speed from one sitting to the next (`blink bench projections`).
- bfloat16 on a CPU with AMX tiles (Sapphire Rapids and later): Blink's AMX kernel (`amx_linear`,
  engine/kernels/amx_linear.cpp) on the plain weight, whatever the row count, instead of oneDNN's packed layout:
  1 row 11.4 -> 8.8 ms, 16 rows 10.8 -> 9.7, a 512-token prefill 142 -> 128; 48-128 rows are where oneDNN's packed
  products stay ahead (up to 1.3x), the price of one copy of the weights and one path (docs/design.md). Not yet
  measured against the blocked kernel, which such a CPU also runs.
- Elsewhere (no AVX-512, or outputs not a multiple of 64): oneDNN with the weight reordered once into its own
  blocked layout (`pack`), instead of a plain tensor it reorders on every call. bfloat16: 12.6 -> 8.8 ms. float32,
  against the split product below (all 12 layers and the output embedding, medians, side by side): as fast for one
  row, 1.9x for 16 (40.8 -> 21.2 ms), 1.3x for a 512-token prefill.
- float32 without oneDNN: MKL's product of a few rows against a weight matrix (a decode step's shape) runs on one
  thread whatever torch's thread count, and for 2-16 rows it is slower still than for one: 29 ms for one row, 57
  ms for two. Split the weight's output rows in as many equal parts as torch has threads (a view: no copy) and a
  batched product hands one part to each thread: 17.7 ms and 28 ms; no slower at prefill sizes.

- Quantized weights (`--quantization`, blink.engine.model.quant): 8- and 4-bit codes in Blink's AVX-512 VNNI kernel
  (engine/kernels/quant_linear.cpp), activations quantized to int8 on the fly.

- FP8 weights (an FP8 checkpoint, `--quantization fp8`; blink.engine.model.fp8): on a GPU with FP8 tensor cores,
  `torch._scaled_mm` with row-wise scales, or a Triton kernel for block-scaled ones; on the CPU dequantized to the
  float dtype at load, then as any float weight.

Other CUDA products go to cuBLAS as they are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from blink.engine.model import fp8, huge_pages, quant

PACKED_DTYPES = (torch.float32, torch.bfloat16)


Weight = torch.Tensor | quant.Quantized | quant.LaidOut | fp8.Fp8Weight
# The output projection's quantization, where it differs from the layers': vLLM's fp8 leaves it in float.
OUTPUT = quant.OUTPUT | {"fp8": None}


def cat(parts: list) -> torch.Tensor | quant.Quantized | fp8.Fp8Weight:
    """Projections fused by their outputs (q, k, v; gate, up), in the form of their parts."""
    if any(isinstance(p, fp8.Fp8Weight) for p in parts):
        return fp8.cat(parts)
    return quant.cat(parts)


def prepare(weight: torch.Tensor | quant.Quantized | fp8.Fp8Weight, quantization: str | None = None) -> Weight:
    """The weight as `linear` runs it fastest here: FP8 where it is or `quantization` asks and this device multiplies
    FP8 (else its FP8 values in the float dtype: blink.engine.model.fp8); quantized where it is (a GGUF's blocks) or
    `quantization` asks (int8, int4; gguf: int8 for a matrix whose type has no repacking), laid out for the VNNI
    kernel; else plain where the AMX kernel takes it, `block`ed where the AVX-512 kernel does, else `pack`ed where
    that pays, else as it is; on the CPU, in huge pages but where oneDNN packs it (blink.engine.model.huge_pages)."""
    if isinstance(weight, fp8.Fp8Weight) or quantization == "fp8":
        weight = fp8.prepare(weight, quantization)
        if isinstance(weight, fp8.Fp8Weight):
            return weight
        quantization = None if quantization == "fp8" else quantization
    if quantization in quant.METHODS and isinstance(weight, torch.Tensor) and quant.takes(weight):
        weight = quant.quantize(weight, "int8" if quantization == "gguf" else quantization)
    if isinstance(weight, quant.Quantized):
        return quant.lay_out(weight)
    if amx_takes(weight):
        return huge_pages.moved(weight)
    if blocked_takes(weight):
        return block(weight)
    return pack(weight) if can_pack(weight) else huge_pages.moved(weight)


@functools.cache
def cpu_kernels():
    """torch.ops.blink_cpu, or None where the CPU kernels cannot be built here."""
    from blink.engine.kernels import cpu

    try:
        return cpu.ops()
    except cpu.Unavailable:
        return None


@functools.cache
def amx_ops():
    """torch.ops.blink_cpu where its AMX projections run on this CPU, else None."""
    ops = cpu_kernels()
    return ops if ops is not None and ops.amx_ready() else None


def amx_takes(weight: torch.Tensor) -> bool:
    """Whether the AMX kernel runs products with this weight as it is."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and weight.is_contiguous()
            and amx_ops() is not None)


BLOCK = 64  # outputs of a block of a `block`ed weight (blocked_linear.cpp)


@functools.cache
def blocked_ops(dtype: torch.dtype):
    """torch.ops.blink_cpu where its AVX-512 projections run for this dtype on this CPU, else None."""
    ops = cpu_kernels()
    return ops if ops is not None and dtype in PACKED_DTYPES and ops.blocked_linear_ready(dtype) else None


def blocked_takes(weight: torch.Tensor) -> bool:
    """Whether the AVX-512 kernel runs products with this weight once it is `block`ed."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[0] % BLOCK == 0 and weight.shape[1] % _per_word(weight.dtype) == 0
            and blocked_ops(weight.dtype) is not None)


def _per_word(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.bfloat16 else 1  # the kernel's step reads 32-bit words of the weight


def block(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] as [N/64, K/E, 64, E], E the elements in a 32-bit word: each block of 64 outputs contiguous, word by
    word of k (a copy)."""
    n, k = weight.shape
    e = _per_word(weight.dtype)
    blocked = weight.view(n // BLOCK, BLOCK, k // e, e).transpose(1, 2)
    return huge_pages.empty(blocked.shape, weight.dtype).copy_(blocked)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `pack` pays off for this weight: float32 or bfloat16 on a CPU whose torch has oneDNN's packed
    products."""
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and _packed_products_work(weight.dtype)


@functools.cache
def _packed_products_work(dtype: torch.dtype) -> bool:
    """The packing ops are torch's internals (Inductor's CPU freezing uses them): tried once per dtype on a small
    weight, so a build without them, or that differs, runs plain products instead."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.ones(8, 16, dtype=dtype), torch.ones(2, 16, dtype=dtype)
        return bool(torch.equal(linear(x, pack(w)), F.linear(x, w)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's layout for products with any number of rows (an opaque tensor only `linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (as torch.nn.Linear holds it), or `prepare`d."""
    if isinstance(weight, fp8.Fp8Weight):
        return fp8.linear(x, weight, bias)
    if not isinstance(weight, torch.Tensor):
        return quant.linear(x, weight, bias)
    if weight.dim() == 4:  # `block`ed
        return blocked_ops(weight.dtype).blocked_linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if x.dtype == torch.bfloat16 and x.dim() == 2 and amx_takes(weight):
        return amx_ops().amx_linear(x, weight, bias)
    parts = torch.get_num_threads()
    n = weight.shape[0]
    if x.device.type != "cpu" or weight.dtype != torch.float32 or parts < 2 or n % parts or x.dim() != 2:
        return F.linear(x, weight, bias)
    out = torch.bmm(x.expand(parts, -1, -1), weight.view(parts, n // parts, -1).transpose(1, 2))  # [parts, M, N/p]
    out = out.transpose(0, 1).reshape(x.shape[0], n)
    return out if bias is None else out + bias
