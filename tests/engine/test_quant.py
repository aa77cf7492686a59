"""Quantized weights on the CPU (blink.engine.model.quant): the VNNI kernel against the torch reference of the same
numbers and against the float product of the dequantized weight; GGUF blocks repacked exactly; whole models
quantized on load and run from a GGUF's blocks, against their float runs; what cannot run, refused by name."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from blink.engine import LLM, SamplingParams
from blink.engine.errors import CheckpointError
from blink.engine.model import quant
from blink.shared.checkpoints import gguf_blocks
from tests.support.gguf_files import write_gguf

Q = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(quant.kernel_ops() is None, reason="needs the CPU kernels built with AVX-512 VNNI")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _from_gguf(kind: Q, shape: tuple[int, int], seed: int = 0) -> quant.Quantized:
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    codes, scale, offset, bits = gguf_blocks.repack(kind, gguf.quants.quantize(w, kind))
    return quant.Quantized(*(torch.from_numpy(a) for a in (codes, scale, offset)), bits)


def _q6_k_blocks(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K rows (gguf cannot quantize to Q6_K): any bytes are valid codes and int8 scales; d kept small."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // 256, 210), dtype=np.uint8)
    blocks[:, 208:] = np.frombuffer(rng.uniform(1e-4, 1e-3, size=len(blocks)).astype(np.float16).tobytes(),
                                    dtype=np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _q6_k(n: int, k: int) -> quant.Quantized:
    codes, scale, offset, bits = gguf_blocks.repack(Q.Q6_K, _q6_k_blocks(n, k))
    return quant.Quantized(*(torch.from_numpy(a) for a in (codes, scale, offset)), bits)


WEIGHTS = {
    "int8": lambda n, k: quant.quantize(torch.randn(n, k), "int8"),
    "int4": lambda n, k: quant.quantize(torch.randn(n, k), "int4"),
    "q8_0": lambda n, k: _from_gguf(Q.Q8_0, (n, k)),
    "q4_0": lambda n, k: _from_gguf(Q.Q4_0, (n, k)),
    "q4_1": lambda n, k: _from_gguf(Q.Q4_1, (n, k)),
}


@needs_kernel
@pytest.mark.parametrize("form", WEIGHTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_the_references_numbers(form, dtype):
    """Every row count a pass of 3 rows leaves over, chunks of k past 1024, a bias; float32 to summation order."""
    torch.manual_seed(0)
    for n, k in ((64, 64), (192, 1152), (128, 2080)):
        q = WEIGHTS[form](n, k)
        laid = quant.lay_out(q)
        assert isinstance(laid, quant.LaidOut)
        for m in (1, 2, 3, 4, 7, 16):
            x, bias = torch.randn(m, k).to(dtype), torch.randn(n)
            got = quant.linear(x, laid, bias)
            assert got.dtype == dtype and got.shape == (m, n)
            assert _relative(got, quant.reference_linear(x, q, bias)) < (1e-5 if dtype == torch.float32 else 1e-2)
            # activations quantized to int8 per 32 inputs: within a percent of the dequantized weight's float product
            assert _relative(got, F.linear(x.float(), q.dequantize(), bias)) < 2e-2


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_runs_q6_k_as_stored(dtype):
    """Q6_K's 6-bit codes with their int8 scales per 16 inputs: the kernel against the reference (float32 to summation
    order), and the reference against gguf's own dequantization times the int8 activations, exactly as a float sum."""
    torch.manual_seed(0)
    for n, k in ((64, 256), (192, 1280), (128, 2304)):  # 1280, 2304: a chunk of 1024 inputs and a part of one
        q = _q6_k(n, k)
        laid = quant.lay_out(q)
        assert isinstance(laid, quant.LaidOut) and laid.bits == 6
        weight = torch.from_numpy(gguf.quants.dequantize(_q6_k_blocks(n, k), Q.Q6_K))
        for m in (1, 2, 3, 4, 7, 16):
            x, bias = torch.randn(m, k).to(dtype), torch.randn(n)
            got = quant.linear(x, laid, bias)
            reference = quant.reference_linear(x, q, bias)
            assert got.dtype == dtype and got.shape == (m, n)
            assert _relative(got, reference) < (1e-5 if dtype == torch.float32 else 1e-2)
            xq, dx, _ = quant.quantize_activations(x)
            exact = F.linear((xq * dx[..., None]).view(m, k).double(), weight.double(), bias.double())
            assert _relative(reference.float() if dtype == torch.float32 else got, exact) < (
                1e-5 if dtype == torch.float32 else 1e-2)
            assert _relative(got, F.linear(x.float(), weight, bias)) < 2e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantizing_on_load_keeps_each_weight_within_its_step(method):
    w = torch.randn(128, 256)
    q = quant.quantize(w, method)
    step = q.scale.float().abs().repeat_interleave(256 // q.scale.shape[1], dim=1)  # a code's worth of each weight
    # int8: to the nearest code; int4 (Q4_0's rule): the group's largest magnitude is -8 steps, +8 clamps to +7
    assert ((q.dequantize() - w).abs() <= step * (0.5 if method == "int8" else 1.0) * 1.001 + 1e-6).all()
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < 2 ** q.bits


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_repack_to_exactly_what_they_dequantize_to(kind):
    data = gguf.quants.quantize(np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32), kind)
    codes, scale, offset, bits = gguf_blocks.repack(kind, data)
    assert codes.shape == (64, 256) and scale.shape == (64, 8) and bits == (4 if kind in (Q.Q4_0, Q.Q4_1) else 8)
    np.testing.assert_array_equal(gguf_blocks.dequantized(codes, scale, offset), gguf.quants.dequantize(data, kind))


def test_q4_k_blocks_repack_to_their_dequantized_values_up_to_float16_scales():
    """Q4_K's sub-block scales times the super-block's: rounded to float16 (2^-11 relative) in the repacking."""
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(32 * 4, 144), dtype=np.uint8)  # 32 rows of 1024 inputs
    blocks[:, 0:4] = np.frombuffer(rng.uniform(1e-3, 1e-2, size=(32 * 4, 2)).astype(np.float16).tobytes(),
                                   dtype=np.uint8).reshape(-1, 4)
    data = blocks.reshape(32, -1)
    codes, scale, offset, bits = gguf_blocks.repack(Q.Q4_K, data)
    expected = gguf.quants.dequantize(data, Q.Q4_K)
    got = gguf_blocks.dequantized(codes, scale, offset)
    assert bits == 4 and codes.max() <= 15
    np.testing.assert_allclose(got, expected, atol=np.abs(expected).max() * 2e-3)


def test_q6_k_blocks_repack_to_exactly_what_they_dequantize_to():
    data = _q6_k_blocks(32, 1024, seed=2)
    codes, scale, offset, bits = gguf_blocks.repack(Q.Q6_K, data)
    assert bits == 6 and codes.max() <= 63 and scale.dtype == np.int8 and offset.shape == (32, 4)
    np.testing.assert_array_equal(gguf_blocks.dequantized(codes, scale, offset), gguf.quants.dequantize(data, Q.Q6_K))
    q = quant.Quantized(*(torch.from_numpy(a) for a in (codes, scale, offset)), bits)
    assert torch.equal(q.dequantize(), torch.from_numpy(gguf.quants.dequantize(data, Q.Q6_K)))


def test_other_gguf_types_have_no_repacking():
    assert gguf_blocks.repack(Q.Q5_K, np.zeros((1, 176), np.uint8)) is None


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor([row[token].logprob for row, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_model_quantized_on_load_scores_text_as_its_float_run_does(method):
    """The tiny model (BLINK_MODEL): each prompt token's log-probability near the float model's, int8 closer."""
    prompt = list(range(3, 60, 2))
    floats = _prompt_logprobs(LLM(os.environ["BLINK_MODEL"], num_pages=32), prompt)
    llm = LLM(os.environ["BLINK_MODEL"], num_pages=32, quantization=method)
    assert isinstance(llm.engine.model.layers[0].gate_up, quant.LaidOut | quant.Quantized)
    error = (_prompt_logprobs(llm, prompt) - floats).abs().max()
    assert error < (0.05 if method == "int8" else 0.5)


@pytest.mark.parametrize(("kind", "blocks"), [("llama-gqa", Q.Q8_0), ("llama-tied", Q.Q8_0), ("llama-gqa", Q.Q5_1)])
def test_a_gguf_runs_its_blocks_as_stored_and_generates_what_its_floats_do(checkpoint, tmp_path, kind, blocks):
    """Q8_0 and Q5_1 blocks (llama's q and k rows un-permuted, a tied embedding's blocks as the output projection),
    against the same file dequantized: greedy tokens equal, log-probabilities close."""
    path = str(write_gguf(checkpoint(kind), tmp_path / "blocks.gguf", quantize=blocks))
    prompt = list(range(5, 40, 3))
    floats = LLM(path, num_pages=32)
    stored = LLM(path, num_pages=32, quantization="gguf")
    model = stored.engine.model
    assert all(isinstance(w, quant.LaidOut | quant.Quantized) for w in (model.layers[0].qkv, model.lm_head))
    assert model.layers[0].qkv.bits == 8 and isinstance(model.embed, torch.Tensor)
    # The weights are the same numbers; the kernel rounds the activations to 8 bits (0.04-0.07 here for every type).
    assert (_prompt_logprobs(stored, prompt) - _prompt_logprobs(floats, prompt)).abs().max() < 0.1
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert stored.generate([prompt], greedy)[0].token_ids == floats.generate([prompt], greedy)[0].token_ids


def test_what_quantization_cannot_run_is_refused_by_name():
    with pytest.raises(CheckpointError, match="--quantization gguf runs the quantized blocks of a GGUF file"):
        LLM(os.environ["BLINK_MODEL"], num_pages=32, quantization="gguf")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        quant.check("int8", torch.device("cuda", 0), "auto", 1)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quant.check("awq", torch.device("cpu"), "auto", 1)
    with pytest.raises(ValueError, match="dummy has none"):
        quant.check("gguf", torch.device("cpu"), "dummy", 1)


def test_bench_quality_scores_every_format_against_the_float_model(checkpoint, tmp_path):
    """A small `blink bench quality` on a Q8_0 file of a test checkpoint, Blink only: each format's perplexity and
    greedy agreement saved; int8, fp8 and the file's own blocks within a few percent of the float perplexity."""
    import json

    from blink.bench.cli import main

    path = write_gguf(checkpoint("llama-gqa"), tmp_path / "q8.gguf", quantize=Q.Q8_0)
    text = tmp_path / "held.txt"
    text.write_text("Once upon a time there was a small model that read the same story again and again. " * 40)
    assert main(["quality", "--model", str(path), "--text", str(text), "--no-llama-cpp", "--requantize", "",
                 "--context", "64", "--chunks", "3", "--prompts", "2", "--new-tokens", "4",
                 "--result-dir", str(tmp_path)]) == 0
    formats = json.loads(next(tmp_path.glob("quality-*.json")).read_text())["formats"]
    assert set(formats) == {"float32", "int8", "int4", "fp8", "gguf:Q8_0"}
    base = formats["float32"]["blink_perplexity"]
    assert formats["float32"]["greedy"]["prefix_share"] == 1.0
    for name in ("int8", "fp8", "gguf:Q8_0"):
        assert abs(formats[name]["blink_perplexity"] / base - 1) < 0.05
