"""FP8 weights (issue 43's GPU half): the checkpoint formats vLLM loads, `--quantization fp8`, and the product.

Formats (`scheme` reads a config.json's `quantization_config`): `quant_method: "fp8"` (per-tensor `weight_scale`, or
`weight_block_size: [128, 128]` with `weight_scale_inv` [N/128, K/128], DeepSeek-V3's and Qwen3-FP8's; a static
`input_scale` where `activation_scheme` is static) and compressed-tensors' float8 (`float-quantized` /
`naive-quantized`, weights by tensor, channel or block), read by hand after compressed-tensors' QuantizationConfig
schema: the package itself requires transformers, which the engine does not import. Weights are E4M3 everywhere.

A weight is `Fp8Weight`: its E4M3 codes, and a float32 scale per output channel ([N, 1]: a per-tensor scale is
spread over the channels, so fused q/k/v with their own scales stay exact) or per block ([N/bn, K/bk]).
`--quantization fp8` quantizes a float weight on load per output channel: vLLM's dynamic FP8 takes one scale per
tensor, a channel's own scale is never coarser, and the product below takes row-wise scales at the same cost.

The product (`linear`), on a GPU with FP8 tensor cores (compute capability 8.9+): activations quantized per token
(amax / 448, in one Triton launch: blink.engine.kernels.fp8_linear.quantize; a checkpoint's static `input_scale`
instead where it has one), then
`torch._scaled_mm` with row-wise float32 scales (the token's, the channel's); block-scaled weights through a Triton
kernel (blink.engine.kernels.fp8_linear) over activations quantized per token and 128 inputs, as DeepSeek-V3's
recipe. No host reads, no syncs: a captured step holds it. Elsewhere (the CPU; older GPUs) there is no FP8 product
worth having: `prepare` dequantizes the weight to the model's float dtype at load, so an FP8 checkpoint runs
correctly there at float speed.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from blink.engine.errors import CheckpointError

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero row's scale, so its codes are zeros rather than NaN
STORED = "F8_E4M3"  # safetensors' name for the codes
WEIGHT_STRATEGIES = ("tensor", "channel", "block")
MIN_BLOCK_INPUTS = 32  # Triton's 8-bit tl.dot on NVIDIA takes K of 32 at least


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's quantization_config says of its FP8 weights."""

    method: str  # fp8 | compressed-tensors
    strategy: str  # tensor | channel | block
    block: tuple[int, int] | None  # outputs x inputs under one scale, strategy block
    static_activations: bool  # activations quantized with the checkpoint's `input_scale` (per tensor)


@dataclass
class Fp8Weight:
    """codes: float8_e4m3fn [N, K]; scale: float32 [N, 1] (per channel) or [ceil(N/bn), ceil(K/bk)] (block);
    input_scale: float32 [] (static activations) or None (per token, on the fly); dtype: the model's float dtype,
    what the product returns and what `dequantize` gives where there is no FP8 product."""

    codes: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None
    input_scale: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.codes.to(device), self.scale.to(device), self.block,
                         None if self.input_scale is None else self.input_scale.to(device), self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.codes.float() * expand_scale(self.scale, self.block, self.shape)).to(dtype or self.dtype)


def expand_scale(scale: torch.Tensor, block: tuple[int, int] | None, shape: torch.Size) -> torch.Tensor:
    """The scale of each element of an [N, K] weight (broadcastable)."""
    if block is None:
        return scale
    n, k = shape
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def scheme(config: dict, source: str) -> Fp8Scheme:
    """A config.json's quantization_config as an FP8 scheme; any other quantization is refused by name."""
    method = config.get("quant_method") or config.get("format") or "unnamed"
    if method == "fp8":
        return _fp8_scheme(config, source)
    if method == "compressed-tensors":
        return _compressed_scheme(config, source)
    raise _refused(source, f"{method} checkpoints")


def _refused(source: str, what: str) -> CheckpointError:
    return CheckpointError(f"{source}: Blink cannot load {what} yet; it loads float32, bfloat16 and float16 "
                           "checkpoints, FP8 ones (quant_method fp8; compressed-tensors float8 weights) and GGUF files")


def _fp8_scheme(config: dict, source: str) -> Fp8Scheme:
    if config.get("fmt", "e4m3") != "e4m3":
        raise _refused(source, f"FP8 weights in {config['fmt']}")
    activations = config.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise CheckpointError(f"{source}: activation_scheme must be dynamic or static, got {activations!r}")
    block = config.get("weight_block_size")
    if block is not None:
        block = _block(block, source, "weight_block_size")
    return Fp8Scheme("fp8", "block" if block else "tensor", block, activations == "static")


def _block(value, source: str, name: str) -> tuple[int, int]:
    ok = isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)
    if not ok or value[1] < 16 or value[1] & (value[1] - 1):
        # the kernel's steps over the inputs are one block each: a power of two the tensor cores take
        raise CheckpointError(f"{source}: {name} must be [outputs, inputs], inputs a power of two from 16, got "
                              f"{value!r}")
    return int(value[0]), int(value[1])


def _compressed_scheme(config: dict, source: str) -> Fp8Scheme:
    fmt = config.get("format", "dense")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise _refused(source, f"compressed-tensors {fmt} checkpoints without config_groups")
    found = set()
    for group in groups:
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        kind = f"{weights.get('type', 'int')}{weights.get('num_bits', '?')}"
        strategy = weights.get("strategy", "tensor")
        if kind != "float8" or strategy not in WEIGHT_STRATEGIES or fmt not in ("float-quantized", "naive-quantized"):
            raise _refused(source, f"compressed-tensors {kind} weights ({fmt}, by {strategy})")
        if inputs and f"{inputs.get('type', 'int')}{inputs.get('num_bits', '?')}" != "float8":
            raise _refused(source, f"compressed-tensors {inputs.get('type')}{inputs.get('num_bits')} activations")
        block = _block(weights.get("block_structure"), source, "block_structure") if strategy == "block" else None
        static = bool(inputs) and not inputs.get("dynamic", True) and inputs.get("strategy", "tensor") == "tensor"
        if inputs and not inputs.get("dynamic", True) and not static:
            raise _refused(source, f"compressed-tensors static activation scales by {inputs.get('strategy')}")
        found.add((strategy, block, static))
    if len(found) > 1:
        raise _refused(source, "compressed-tensors checkpoints whose groups quantize differently")
    strategy, block, static = found.pop()
    return Fp8Scheme("compressed-tensors", strategy, block, static)


def read(get, name: str, has, the_scheme: Fp8Scheme, dtype: torch.dtype, source: str) -> Fp8Weight:
    """A stored FP8 weight `name` (…weight) with its scales: get(name) reads a tensor, has(name) says whether the
    checkpoint holds one."""
    stem = name.removesuffix("weight")
    codes = get(name)
    if codes.dim() != 2:
        raise CheckpointError(f"{source}: {name} is FP8 but not a matrix ({list(codes.shape)})")
    scale_name = next((stem + s for s in ("weight_scale_inv", "weight_scale") if has(stem + s)), None)
    if scale_name is None:
        raise CheckpointError(f"{source}: {name} is FP8 but {stem}weight_scale is missing")
    scale = get(scale_name).float()
    n, k = codes.shape
    if the_scheme.block is not None:
        bn, bk = the_scheme.block
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != want:
            raise CheckpointError(f"{source}: {scale_name} is {list(scale.shape)}; blocks of {bn}x{bk} over "
                                  f"{list(codes.shape)} need {list(want)}")
    elif scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1).contiguous()
    elif scale.numel() == n:
        scale = scale.reshape(n, 1).contiguous()
    else:
        raise CheckpointError(f"{source}: {scale_name} has {scale.numel()} values: one, or one per output ({n}), "
                              f"for {name}")
    input_scale = None
    if the_scheme.static_activations:
        if not has(stem + "input_scale"):
            raise CheckpointError(f"{source}: static activation scales, but {stem}input_scale is missing")
        input_scale = get(stem + "input_scale").float().reshape(())
    return Fp8Weight(codes, scale, the_scheme.block, input_scale, dtype)


def quantize(weight: torch.Tensor) -> Fp8Weight:
    """A float weight [N, K] in E4M3 with a scale per output channel (amax / 448)."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / E4M3_MAX
    return Fp8Weight((w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale, None, None, weight.dtype)


def cat(parts: list[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Projections fused by their outputs (q, k, v; gate, up), at least one of them FP8."""
    dtype = next(p.dtype for p in parts if isinstance(p, Fp8Weight))
    blocks = {p.block for p in parts if isinstance(p, Fp8Weight)}
    aligned = all(isinstance(p, Fp8Weight) for p in parts) and len(blocks) == 1 and (
        None in blocks or all(p.shape[0] % p.block[0] == 0 for p in parts[:-1]))
    if not aligned:
        # a float part (an ignored layer) or blocks that straddle the seams: the fused weight in the float dtype
        return torch.cat([p.dequantize() if isinstance(p, Fp8Weight) else p.to(dtype) for p in parts])
    statics = [p.input_scale for p in parts if p.input_scale is not None]
    # One activation scale for the fused product: the largest, as vLLM takes it, so no part's inputs clip more.
    input_scale = torch.stack(statics).amax() if len(statics) == len(parts) else None
    return Fp8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), parts[0].block,
                     input_scale, dtype)


@functools.cache
def products_run_on(device: torch.device) -> bool:
    """Whether this device multiplies FP8 (CUDA, compute capability 8.9 and later: Ada, Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def takes(weight: torch.Tensor | Fp8Weight) -> bool:
    """Whether the product takes this shape (_scaled_mm: outputs and inputs multiples of 16)."""
    return len(weight.shape) == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def prepare(weight: torch.Tensor | Fp8Weight, quantization: str | None) -> torch.Tensor | Fp8Weight:
    """An FP8 weight as this device runs it, or a float weight `--quantization fp8` asks for in FP8: kept in FP8
    where the product runs, else a float tensor of the FP8 values (dequantized at load)."""
    if isinstance(weight, torch.Tensor):
        if quantization != "fp8" or not takes(weight):
            return weight
        weight = quantize(weight)
    why = None
    if not products_run_on(weight.codes.device):
        why = "no FP8 product here"
    elif weight.block is not None and weight.block[1] < MIN_BLOCK_INPUTS:
        why = (f"blocks of {weight.block[1]} inputs, fewer than the {MIN_BLOCK_INPUTS} an 8-bit tensor-core product "
               "steps over (the kernel steps a block at a time)")
    elif weight.block is None and not takes(weight):
        why = "a shape torch._scaled_mm does not take (outputs and inputs multiples of 16)"
    if why is not None:
        _say_dequantized(weight.codes.device.type, why)
        return weight.dequantize()
    return weight


@functools.cache
def _say_dequantized(device: str, why: str) -> None:
    log.warning("FP8 weights on %s: %s, so they run dequantized to the model's float dtype (FP8's numbers, not its "
                "speed or memory)", device, why)


def check(quantization: str | None, the_scheme: Fp8Scheme | None, tensor_parallel_size: int) -> None:
    """Raises ValueError, saying why, where FP8 weights cannot run as asked."""
    if the_scheme is not None and quantization not in (None, "fp8"):
        raise ValueError(f"--quantization {quantization}: the checkpoint's weights are FP8 ({the_scheme.method}); "
                         "leave --quantization unset (or fp8) to run them")
    if (the_scheme is not None or quantization == "fp8") and tensor_parallel_size > 1:
        raise ValueError("FP8 weights do not split over tensor-parallel ranks yet (--tensor-parallel-size 1)")


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] in E4M3 and its float32 scale per row [M, 1]: amax / 448 of each token, or the static scale."""
    x32 = x.float()
    if input_scale is None:
        scale = x32.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / E4M3_MAX
    else:
        scale = input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] in E4M3 with a float32 scale per row and `group` inputs [M, ceil(K/group)] (DeepSeek-V3's 1x128)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = padded.abs().amax(dim=2, keepdim=True).clamp(min=MIN_AMAX) / E4M3_MAX
    codes = (padded / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(m, groups * group)[:, :k]
    return codes.contiguous(), scale[..., 0]


def emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm's numbers with row-wise scales, in float32 torch: (a @ b) * scale_a * scale_b."""
    return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)


def _cuda_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None, scaled_mm=_cuda_scaled_mm,
           block_product=None) -> torch.Tensor:
    """x [M, K] @ weight.T in FP8: a per-channel weight through `scaled_mm` (torch._scaled_mm), a block-scaled one
    through `block_product` (the Triton kernel). Returns x's dtype. The tests hand the emulations in."""
    if x.is_cuda:  # one launch for the activations' codes and scales
        from blink.engine.kernels.fp8_linear import quantize
    if weight.block is None:
        xq, xs = (quantize(x.contiguous(), None, weight.input_scale) if x.is_cuda
                  else quantize_rows(x, weight.input_scale))
        # row-wise _scaled_mm writes bfloat16 (cuBLAS's row-wise FP8 kernels have no other output)
        out = scaled_mm(xq, weight.codes.t(), xs, weight.scale.view(1, -1), torch.bfloat16)
    else:
        if block_product is None:
            from blink.engine.kernels.fp8_linear import block_linear as block_product
        group = weight.block[1]
        xq, xs = quantize(x.contiguous(), group) if x.is_cuda else quantize_groups(x, group)
        out = block_product(xq, xs, weight.codes, weight.scale, weight.block, x.dtype)
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def reference_block_linear(xq: torch.Tensor, xs: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                           block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """The block kernel's numbers in torch: per input block, the E4M3 dot products times both blocks' scales."""
    m, k = xq.shape
    bk = block[1]
    n = codes.shape[0]
    out = torch.zeros(m, n, device=xq.device)
    w_scale = scale.repeat_interleave(block[0], 0)[:n]  # [N, K/bk]
    for g, start in enumerate(range(0, k, bk)):
        dots = xq[:, start:start + bk].float() @ codes[:, start:start + bk].float().t()
        out += dots * xs[:, g:g + 1] * w_scale[:, g][None, :]
    return out.to(out_dtype)
