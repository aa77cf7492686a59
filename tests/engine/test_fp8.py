"""FP8 weights (blink.engine.model.fp8): checkpoints written as vLLM expects them (fp8 per tensor with static
activation scales, 128x128 blocks; compressed-tensors by channel and by block) loaded and run on the CPU against the
float checkpoint of their dequantized values; `--quantization fp8` against the float model; the GPU's products
(torch._scaled_mm's numbers emulated, the block kernel in Triton's interpreter) against float products; what cannot
load refused by name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from blink.engine import LLM, SamplingParams
from blink.engine.errors import CheckpointError
from blink.engine.kernels.fp8_linear import block_linear, quantize
from blink.engine.model import fp8
from blink.engine.model.checkpoint import FP8_PROJECTION
from blink.engine.model.config import ModelConfig
from tests.support.kernel_inputs import DEVICE


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _ct_group(strategy: str, static: bool) -> dict:
    """A compressed-tensors config group as llm-compressor writes one."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
              "strategy": "tensor" if static else "token"}
    return {"targets": ["Linear"], "weights": weights, "input_activations": inputs}


def _ct_config(strategy: str, static: bool = False) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": _ct_group(strategy, static)}}


# name: (quantization_config, how each weight is scaled, whether activation scales are stored)
FORMATS = {
    "fp8-tensor-static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor", True),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [128, 128]}, "block", False),
    "ct-channel": (_ct_config("channel"), "channel", False),
    "ct-block": (_ct_config("block"), "block", False),
    "ct-tensor-static": (_ct_config("tensor", static=True), "tensor", True),
}


def _quantized(w: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """codes and the stored scale of a float weight, as a quantizer of each format writes them."""
    w = w.float()
    if how == "tensor":
        scale = w.abs().amax() / fp8.E4M3_MAX
        return (w / scale).to(fp8.E4M3), scale.reshape(1)
    if how == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / fp8.E4M3_MAX
        return (w / scale).to(fp8.E4M3), scale
    n, k = w.shape
    blocks = w.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3))
    scale = blocks / fp8.E4M3_MAX
    return (w / fp8.expand_scale(scale, (128, 128), w.shape)).to(fp8.E4M3), scale


def write_fp8_checkpoint(source: Path, fp8_dir: Path, float_dir: Path, form: str) -> None:
    """`source` (a float checkpoint) as an FP8 checkpoint in `form` (every projection; the embeddings, norms and
    the output projection in float, as vLLM's and llm-compressor's quantizers leave them), and the float checkpoint
    of the FP8 weights' dequantized values beside it."""
    config_json, how, static = FORMATS[form]
    tensors = load_file(str(source / "model.safetensors"))
    stored, floats = {}, {}
    for name, t in tensors.items():
        if not FP8_PROJECTION.fullmatch(name):
            stored[name] = floats[name] = t
            continue
        codes, scale = _quantized(t, how)
        stem = name.removesuffix("weight")
        scale_name = "weight_scale_inv" if form == "fp8-block" else "weight_scale"
        stored[name], stored[stem + scale_name] = codes, scale
        if static:
            stored[stem + "input_scale"] = torch.tensor([0.05])
        floats[name] = (codes.float() * fp8.expand_scale(scale.reshape(-1, 1) if how != "block" else scale,
                                                         (128, 128) if how == "block" else None, t.shape))
    for target, weights, extra in ((fp8_dir, stored, {"quantization_config": config_json}), (float_dir, floats, {})):
        shutil.copytree(source, target)
        (target / "model.safetensors").unlink()
        save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(config | extra))


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor([row[token].logprob for row, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)])


@pytest.mark.parametrize("form", FORMATS)
def test_an_fp8_checkpoint_runs_as_its_dequantized_floats_do(form, tmp_path):
    """The tiny model in each format, on the CPU (dequantized at load): greedy tokens equal and prompt
    log-probabilities within float32's rounding of the float checkpoint holding the same values."""
    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    write_fp8_checkpoint(Path(os.environ["BLINK_MODEL"]), fp8_dir, float_dir, form)
    cfg = ModelConfig.from_dir(fp8_dir)
    assert cfg.fp8 is not None and cfg.fp8.strategy == FORMATS[form][1]
    prompt = list(range(5, 60, 3))
    quantized, floats = LLM(str(fp8_dir), num_pages=32), LLM(str(float_dir), num_pages=32)
    assert isinstance(quantized.engine.model.layers[0].qkv, torch.Tensor)  # no FP8 product on the CPU
    assert (_prompt_logprobs(quantized, prompt) - _prompt_logprobs(floats, prompt)).abs().max() < 1e-4
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert quantized.generate([prompt], greedy)[0].token_ids == floats.generate([prompt], greedy)[0].token_ids


def test_fp8_weights_load_with_their_scales(tmp_path):
    """What the GPU gets: the projections in E4M3 with float32 scales of the stored shapes, a per-tensor scale
    spread over the channels, q, k and v fused with the largest static activation scale."""
    from blink.engine.model.checkpoint import load_tensors
    from blink.engine.model.linear import cat
    from blink.engine.model.model import checkpoint_tensor_names

    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    write_fp8_checkpoint(Path(os.environ["BLINK_MODEL"]), fp8_dir, float_dir, "fp8-tensor-static")
    cfg = ModelConfig.from_dir(fp8_dir)
    tensors = load_tensors(fp8_dir, set(checkpoint_tensor_names(cfg)), torch.float32, cfg.fp8)
    floats = load_file(str(float_dir / "model.safetensors"))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, fp8.Fp8Weight) and q.codes.dtype == fp8.E4M3 and q.scale.shape == (q.shape[0], 1)
    assert torch.equal(q.dequantize(), floats["model.layers.0.self_attn.q_proj.weight"])
    assert isinstance(tensors["lm_head.weight"], torch.Tensor)
    parts = [tensors[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
    for part, value in zip(parts, (0.05, 0.2, 0.1), strict=True):
        part.input_scale = torch.tensor(value)
    fused = cat(parts)
    assert isinstance(fused, fp8.Fp8Weight) and fused.input_scale.item() == pytest.approx(0.2)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_quantization_fp8_scores_text_near_the_float_model():
    """--quantization fp8 on the tiny model (weights rounded to E4M3 per output channel; on the CPU they then run
    in float32): each prompt token's log-probability within 0.05 of the float model's (int8's bound)."""
    prompt = list(range(3, 60, 2))
    floats = _prompt_logprobs(LLM(os.environ["BLINK_MODEL"], num_pages=32), prompt)
    llm = LLM(os.environ["BLINK_MODEL"], num_pages=32, quantization="fp8")
    qkv = llm.engine.model.layers[0].qkv
    assert isinstance(qkv, torch.Tensor) and not torch.equal(qkv, LLM(os.environ["BLINK_MODEL"], num_pages=32)
                                                              .engine.model.layers[0].qkv)
    error = (_prompt_logprobs(llm, prompt) - floats).abs().max()
    assert 0 < error < 0.05


def test_quantizing_to_fp8_keeps_each_weight_within_e4m3s_step():
    """Per output channel: every value within half an E4M3 step of its magnitude (3 mantissa bits: 1/16), the
    channel's largest exact."""
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.rand(64, 1) * 3
    q = fp8.quantize(w)
    back = q.dequantize(torch.float32)
    assert q.codes.dtype == fp8.E4M3 and q.scale.shape == (64, 1)
    step = torch.maximum(w.abs(), q.scale * 2**-6)  # below E4M3's normal range its steps are fixed
    assert ((back - w).abs() <= step / 16 + 1e-7).all()
    assert torch.allclose(back.abs().amax(dim=1), w.abs().amax(dim=1))


def _per_channel(n: int, k: int) -> fp8.Fp8Weight:
    return fp8.quantize(torch.randn(n, k) * 0.05)


@pytest.mark.parametrize("static", [False, True])
def test_the_scaled_mm_product_is_the_float_product_of_its_fp8_values(static):
    """The GPU's per-channel path with torch._scaled_mm emulated in float32: exactly the product of the E4M3
    activations and codes times both scales; within E4M3's rounding (a few percent) of the float product of the
    dequantized weight. torch's own _scaled_mm on the CPU computes the same numbers."""
    torch.manual_seed(0)
    w = _per_channel(96, 128)
    if static:
        w.input_scale = torch.tensor(4.0 / fp8.E4M3_MAX)  # activations within ±4: none clip
    bias = torch.randn(96).to(torch.bfloat16)
    for m in (1, 5, 32):
        x = (torch.rand(m, 128) * 8 - 4).to(torch.bfloat16)
        got = fp8.linear(x, w, bias, scaled_mm=fp8.emulated_scaled_mm)
        xq, xs = fp8.quantize_rows(x, w.input_scale)
        exact = (xq.float() @ w.codes.float().t()) * xs * w.scale.view(1, -1)
        assert got.dtype == torch.bfloat16 and _relative(got - bias, exact) < 1e-2
        assert _relative(got, F.linear(x.float(), w.dequantize(torch.float32), bias.float())) < 5e-2
        torch_mm = torch._scaled_mm(xq, w.codes.t(), scale_a=xs, scale_b=w.scale.view(1, -1), out_dtype=torch.float32)
        assert _relative(fp8.emulated_scaled_mm(xq, w.codes.t(), xs, w.scale.view(1, -1), torch.float32),
                         torch_mm) < 1e-5


def _e4m3_ulp(v: torch.Tensor) -> torch.Tensor:
    """The step between E4M3 values around v: 3 mantissa bits, subnormals below 2^-6 in steps of 2^-9."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=2**-6))) - 3)


@pytest.mark.parametrize(("m", "k", "group", "static"), [(3, 300, None, False), (4, 300, 128, False),
                                                         (2, 5000, None, False), (5, 256, 128, False),
                                                         (3, 300, None, True)])
def test_the_quantize_kernel_computes_the_references_numbers(m, k, group, static):
    """Activations in one launch (interpreted without a GPU, compiled with one): the scales exactly torch's, per
    row or per row and 128 inputs, an all-zero row's included; the codes torch's on a GPU. Triton 3.6's interpreter
    narrows to E4M3 by its own rule: a code within one step of x / scale, except that a value rounding up to a
    power of two loses the carry into the exponent (-126.2 becomes -64, not -128); the GPU's conversion does not."""
    torch.manual_seed(0)
    x = (torch.randn(m, k, device=DEVICE) * 3).to(torch.bfloat16)
    x[0] = 0
    static_scale = torch.tensor(0.01, device=DEVICE) if static else None
    q, scale = quantize(x, group, static_scale)
    want_q, want_scale = (fp8.quantize_rows(x, static_scale) if group is None else fp8.quantize_groups(x, group))
    assert q.dtype == fp8.E4M3 and torch.equal(scale, want_scale)
    if DEVICE.type == "cuda":
        assert torch.equal(q.float(), want_q.float())
        return
    exact = (x.float() / fp8.expand_scale(scale, None if group is None else (1, group), x.shape)).clamp(-448, 448)
    got, want = q.float(), want_q.float()
    lost_carry = (got * 2 == want) & (torch.log2(want.abs()) % 1 == 0)
    assert ((got - exact).abs() < _e4m3_ulp(exact))[~lost_carry].all()
    assert lost_carry.float().mean() < 0.05


@pytest.mark.parametrize(("n", "k", "block"), [(256, 384, (128, 128)), (200, 300, (128, 128)), (96, 80, (64, 32))])
def test_the_block_kernel_computes_the_references_numbers(n, k, block):
    """The Triton kernel (interpreted without a GPU, compiled with one) against its torch reference, ragged edges
    included; within E4M3's rounding of the float product of the dequantized weight."""
    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEVICE) * 0.05
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), device=DEVICE) * 1e-3 + 1e-4
    codes = (w / fp8.expand_scale(scale, block, w.shape)).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.E4M3)
    weight = fp8.Fp8Weight(codes, scale, block, None, torch.float32)
    for m in (1, 3, 17, 70):
        x = torch.randn(m, k, device=DEVICE)
        xq, xs = fp8.quantize_groups(x, block[1])
        got = block_linear(xq, xs, codes, scale, block, torch.float32)
        assert _relative(got, fp8.reference_block_linear(xq, xs, codes, scale, block, torch.float32)) < 1e-5
        assert _relative(fp8.linear(x, weight), F.linear(x, weight.dequantize())) < 5e-2


def test_where_the_fp8_products_run_blocks_narrower_than_the_tensor_cores_run_dequantized(monkeypatch):
    """On a device with FP8 products, a block-scaled weight stays FP8 unless its blocks step over fewer inputs than
    an 8-bit tensor-core product takes (Triton's K of 32): that one runs as its dequantized floats, not as a kernel
    that would not compile."""
    monkeypatch.setattr(fp8, "products_run_on", lambda device: True)
    w = torch.randn(64, 64) * 0.05
    for inputs, stays in ((32, True), (16, False)):
        block = (32, inputs)
        scale = torch.rand(64 // block[0], 64 // inputs) * 1e-3 + 1e-4
        codes = (w / fp8.expand_scale(scale, block, w.shape)).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.E4M3)
        weight = fp8.Fp8Weight(codes, scale, block, None, torch.float32)
        got = fp8.prepare(weight, None)
        assert isinstance(got, fp8.Fp8Weight) == stays
        if not stays:
            torch.testing.assert_close(got, weight.dequantize())


def test_what_fp8_cannot_load_is_refused_by_name():
    base = json.loads((Path(os.environ["BLINK_MODEL"]) / "config.json").read_text())
    refused = {"awq": {"quant_method": "awq", "bits": 4}, "gptq": {"quant_method": "gptq", "bits": 4},
               "mxfp4": {"quant_method": "mxfp4"}, "bitsandbytes": {"quant_method": "bitsandbytes"},
               "compressed-tensors int4 weights": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                   "config_groups": {"g": {"weights": {"num_bits": 4,
                                                                                       "type": "int"}}}},
               "compressed-tensors int8 weights": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                                   "config_groups": {"g": {"weights": {"num_bits": 8,
                                                                                       "type": "int"}}}},
               "e5m2": {"quant_method": "fp8", "fmt": "e5m2"}}
    for name, config in refused.items():
        with pytest.raises(CheckpointError, match=f"Blink cannot load .*{name}.* yet"):
            ModelConfig.from_dict(base | {"quantization_config": config})
    with pytest.raises(CheckpointError, match="weight_block_size"):
        ModelConfig.from_dict(base | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 100]}})
    cfg = ModelConfig.from_dict(base | {"quantization_config": FORMATS["fp8-block"][0]})
    with pytest.raises(ValueError, match="the checkpoint's weights are FP8"):
        fp8.check("int8", cfg.fp8, 1)
    with pytest.raises(ValueError, match="tensor-parallel"):
        fp8.check("fp8", None, 2)


def test_a_scale_of_the_wrong_shape_is_refused(tmp_path):
    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    write_fp8_checkpoint(Path(os.environ["BLINK_MODEL"]), fp8_dir, float_dir, "fp8-block")
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.ones(3, 3)
    save_file(tensors, str(fp8_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"down_proj.weight_scale_inv is \[3, 3\]; blocks of 128x128"):
        LLM(str(fp8_dir), num_pages=32)


@pytest.mark.gpu
def test_on_a_gpu_fp8_weights_stay_fp8_and_score_text_as_their_floats_do(tmp_path):
    """Where FP8 products run: torch._scaled_mm gives the emulation's numbers; a per-channel and a block-scaled
    checkpoint keep their projections in FP8 and score each prompt token within 0.05 of their dequantized floats
    in bfloat16; so does --quantization fp8 against the float model."""
    if not fp8.products_run_on(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("needs FP8 products (compute capability 8.9+)")
    torch.manual_seed(0)
    w = _per_channel(256, 512).to("cuda")
    x = torch.randn(7, 512, device="cuda", dtype=torch.bfloat16)
    assert _relative(fp8.linear(x, w), fp8.linear(x, w, scaled_mm=fp8.emulated_scaled_mm)) < 1e-2
    prompt = list(range(5, 60, 3))
    for form in ("ct-channel", "fp8-block"):
        fp8_dir, float_dir = tmp_path / form / "fp8", tmp_path / form / "float"
        write_fp8_checkpoint(Path(os.environ["BLINK_MODEL"]), fp8_dir, float_dir, form)
        quantized = LLM(str(fp8_dir), num_pages=32, dtype="bfloat16", device="cuda")
        assert isinstance(quantized.engine.model.layers[0].qkv, fp8.Fp8Weight)
        floats = LLM(str(float_dir), num_pages=32, dtype="bfloat16", device="cuda")
        assert (_prompt_logprobs(quantized, prompt) - _prompt_logprobs(floats, prompt)).abs().max() < 0.05
    floats = _prompt_logprobs(LLM(os.environ["BLINK_MODEL"], num_pages=32, dtype="bfloat16", device="cuda"), prompt)
    llm = LLM(os.environ["BLINK_MODEL"], num_pages=32, dtype="bfloat16", device="cuda", quantization="fp8")
    assert isinstance(llm.engine.model.layers[0].gate_up, fp8.Fp8Weight)
    assert (_prompt_logprobs(llm, prompt) - floats).abs().max() < 0.05


@pytest.mark.parametrize("form", ["ct-channel", "fp8-block"])
def test_the_fp8_products_run_the_model_as_a_gpu_would(form, tmp_path, monkeypatch):
    """The GPU's path through the whole model on the CPU: FP8 products declared to run here, so the projections
    stay FP8 (fused q/k/v and gate/up included) and run torch's own _scaled_mm on the CPU (row-wise scales, the
    contract cuBLAS's kernel keeps) or the block kernel in the interpreter; each prompt token's log-probability
    within 0.1 of the dequantized floats' (0.03 on average: the activations' E4M3 rounding, and _scaled_mm's
    bfloat16 output in this float32 model), greedy tokens mostly equal."""
    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    write_fp8_checkpoint(Path(os.environ["BLINK_MODEL"]), fp8_dir, float_dir, form)
    monkeypatch.setattr(fp8, "products_run_on", lambda device: True)
    quantized, floats = LLM(str(fp8_dir), num_pages=32), LLM(str(float_dir), num_pages=32)
    layer = quantized.engine.model.layers[0]
    assert all(isinstance(w, fp8.Fp8Weight) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert layer.qkv.shape[0] == 256 + 2 * 128 and (layer.qkv.input_scale is not None) == FORMATS[form][2]
    prompt = list(range(5, 60, 3))
    error = (_prompt_logprobs(quantized, prompt) - _prompt_logprobs(floats, prompt)).abs()
    assert error.max() < 0.1 and error.mean() < 0.03
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got, want = (llm.generate([prompt], greedy)[0].token_ids for llm in (quantized, floats))
    assert sum(a == b for a, b in zip(got, want, strict=True)) >= 8
