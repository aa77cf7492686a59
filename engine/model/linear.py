"""The model's projections (x @ W.T), and how the CPU runs them at full bandwidth.

Measured on this project's 2-core VMs, a token of a 125M Llama, all its projections:

- bfloat16 on a CPU with AMX tiles (Sapphire Rapids and later): Blink's own kernel (`amx_linear`,
  engine/kernels/amx_linear.cpp) on the plain weight, whatever the row count, instead of oneDNN's packed layout:
  1 row 11.4 -> 8.8 ms, 16 rows 10.8 -> 9.7, a 512-token prefill 142 -> 128; 48-128 rows are where oneDNN's packed
  products stay ahead (up to 1.3x), the price of one copy of the weights and one path (docs/design.md).
- Both dtypes elsewhere: oneDNN with the weight reordered once into its own blocked layout (`pack`), instead of a
  plain tensor it reorders on every call. bfloat16: 12.6 -> 8.8 ms. float32, against the split product below (all
  12 layers and the output embedding, medians, side by side): as fast for one row, 1.9x for 16 (40.8 -> 21.2 ms),
  1.3x for a 512-token prefill; `LLM.generate` decoding 16 sequences, 290 -> 471 tokens/s.
- float32 without oneDNN: MKL's product of a few rows against a weight matrix (a decode step's shape) runs on one
  thread whatever torch's thread count, and for 2-16 rows it is slower still than for one: 29 ms for one row, 57
  ms for two. Split the weight's output rows in as many equal parts as torch has threads (a view: no copy) and a
  batched product hands one part to each thread: 17.7 ms and 28 ms; no slower at prefill sizes.

CUDA products go to cuBLAS as they are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def prepare(weight: torch.Tensor) -> torch.Tensor:
    """The weight as `linear` runs it fastest here: plain where the AMX kernel takes it, else `pack`ed where that
    pays, else as it is."""
    if _amx_takes(weight):
        return weight
    return pack(weight) if can_pack(weight) else weight


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


@functools.cache
def amx_ops():
    """torch.ops.blink_cpu where its AMX projections run on this CPU, else None."""
    from blink.engine.kernels import cpu

    try:
        ops = cpu.ops()
    except cpu.Unavailable:
        return None
    return ops if ops.amx_ready() else None


def _amx_takes(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and weight.is_contiguous()
            and amx_ops() is not None)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's layout for products with any number of rows (an opaque tensor only `linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (as torch.nn.Linear holds it), or `prepare`d."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if x.dtype == torch.bfloat16 and x.dim() == 2 and _amx_takes(weight):
        return amx_ops().amx_linear(x, weight, bias)
    parts = torch.get_num_threads()
    n = weight.shape[0]
    if x.device.type != "cpu" or weight.dtype != torch.float32 or parts < 2 or n % parts or x.dim() != 2:
        return F.linear(x, weight, bias)
    out = torch.bmm(x.expand(parts, -1, -1), weight.view(parts, n // parts, -1).transpose(1, 2))  # [parts, M, N/p]
    out = out.transpose(0, 1).reshape(x.shape[0], n)
    return out if bias is None else out + bias
