"""FP8 KV pages (`--kv-cache-dtype fp8`, issue 43): the Triton kernels' cache write quantizing with the layer's scales,
attention over float8 pages against the same attention over their dequantized pages (and the float pages, within
FP8's error), the engine's greedy tokens with FP8 pages beside the model dtype's, the checkpoint's scales, the pool's
bytes, the rotation mirror, and the refusal where the kernels that would run cannot read FP8 pages."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from blink.engine import LLM, SamplingParams
from blink.engine.core import kv_dtype
from blink.engine.core.kv_cache import PagePool
from blink.engine.core.rotation import HostMirror, PageMoves
from blink.engine.core.scheduler import QUERY_BLOCK
from blink.engine.engine import EngineConfig
from blink.engine.kernels import attention as attention_kernel
from blink.engine.kernels.rope_kv import rope_and_cache
from tests.support.kernel_inputs import DEVICE, rope_tables, scene

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SEQUENCES = [(300, 1), (37, 1), (0, 70), (100, 20), (5, 1), (63, 1)]


def _quantized(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    top = torch.finfo(fp8).max
    return (x.float() / scale).clamp(-top, top).to(fp8)


def _dequantized(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale).to(dtype)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("dtype", "splits"), [(torch.float32, 4), (torch.bfloat16, 1), (torch.float16, 2)])
def test_attention_over_fp8_pages_is_attention_over_their_dequantized_pages(fp8, dtype, splits):
    page_size, kv_heads, group, head_dim = 8, 2, 2, 16
    q, k, v, k_cache, v_cache, table, write_rows, decode_rows, chunk_rows = scene(
        SEQUENCES, page_size, kv_heads, group, head_dim, dtype)
    for cache, new in ((k_cache, k), (v_cache, v)):  # this step's K/V written first, as attention expects
        cache.view(-1, kv_heads, head_dim)[write_rows] = new
    scales = torch.tensor([0.5, 2.0], device=DEVICE)  # K's and V's: a scale is applied, not assumed 1
    k_codes, v_codes = _quantized(k_cache, 0.5, fp8), _quantized(v_cache, 2.0, fp8)
    groups = [(decode_rows, 1), (chunk_rows, QUERY_BLOCK)]
    scale = head_dim ** -0.5

    def attend(kc, vc, kv_scales=None):
        return attention_kernel.attention(q, kc, vc, groups, table, scale, None, write_rows, splits=splits,
                                          min_span=attention_kernel.KEY_TILE, kv_scales=kv_scales)

    got = attend(k_codes, v_codes, scales)
    dequantized = attend(_dequantized(k_codes, 0.5, dtype), _dequantized(v_codes, 2.0, dtype))
    torch.testing.assert_close(got, dequantized, atol=1e-6, rtol=1e-6)
    # Against the float pages: FP8's error (E4M3: 3 mantissa bits, E5M2: 2) averaged over the keys.
    error = (got.float() - attend(k_cache, v_cache).float()).abs()
    worst, typical = (0.15, 0.015) if fp8 == torch.float8_e4m3fn else (0.3, 0.03)
    assert error.max() < worst and error.mean() < typical, (error.max(), error.mean())
    assert (got.float() - dequantized.float()).abs().max() < error.max()  # the pages' rounding, not the kernel's


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_write_quantizes_with_the_scale(fp8, dtype):
    gen = torch.Generator().manual_seed(2)
    B, padding, num_pages, page_size, heads, kv_heads, head_dim = 19, 3, 10, 4, 4, 2, 16
    q = torch.randn(B, heads, head_dim, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(B, kv_heads, head_dim, generator=gen).mul(40).to(DEVICE, dtype) for _ in range(2))
    cos, sin = (t.to(DEVICE) for t in rope_tables(64, head_dim, dtype))
    positions = torch.randint(0, 64, (B,), generator=gen).to(DEVICE)
    rows = (torch.randperm((num_pages - 1) * page_size, generator=gen)[:B] + page_size).to(DEVICE)
    rows[B - padding:] = 0
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.zeros(shape, dtype=fp8, device=DEVICE) for _ in range(2))
    scales = torch.tensor([0.25, 0.125], device=DEVICE)  # values up to ~160 / 0.125: E4M3 saturates at 448
    roped = rope_and_cache(q, k, v, cos, sin, positions, rows, k_cache, v_cache, scales)
    # The same write into caches of the model's dtype (checked against the reference in test_kernels.py), quantized.
    k_float, v_float = (torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(2))
    assert torch.equal(rope_and_cache(q, k, v, cos, sin, positions, rows, k_float, v_float), roped)
    real = rows[:B - padding]
    got_k, got_v = (c.view(-1, kv_heads, head_dim)[real] for c in (k_cache, v_cache))
    expected_k = _quantized(k_float.view(-1, kv_heads, head_dim)[real], 0.25, fp8)
    expected_v = _quantized(v[:B - padding], 0.125, fp8)
    assert torch.equal(got_k.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), expected_v.view(torch.uint8))
    if fp8 == torch.float8_e4m3fn:  # saturated at 448, not NaN (E5M2 reaches 57344: no value here is near)
        assert torch.finfo(fp8).max in got_v.float().abs()
    assert torch.isfinite(got_k.float()).all() and torch.isfinite(got_v.float()).all()


@pytest.mark.parametrize("fp8", FP8)
def test_the_fused_launch_writes_what_rope_and_cache_writes_and_reads_its_keys_as_stored(fp8):
    dtype, page_size, group, head_dim, kv_heads = torch.bfloat16, 4, 2, 16, 2
    q, k, v, k_cache, v_cache, table, write_rows, decode_rows, chunk_rows = scene(
        SEQUENCES, page_size, kv_heads, group, head_dim, dtype)
    positions = torch.cat([torch.arange(done, done + take) for done, take in SEQUENCES] + [torch.zeros(3)]).long()
    cos, sin = (t.to(DEVICE) for t in rope_tables(512, head_dim, dtype))
    positions, scale = positions.to(DEVICE), head_dim ** -0.5
    scales = torch.tensor([0.5, 0.25], device=DEVICE)
    k_codes, v_codes = _quantized(k_cache, 0.5, fp8), _quantized(v_cache, 0.25, fp8)
    groups = [(decode_rows, 1), (chunk_rows, QUERY_BLOCK)]
    k_written, v_written = k_codes.clone(), v_codes.clone()
    roped = rope_and_cache(q, k, v, cos, sin, positions, write_rows, k_written, v_written, scales)
    expected = attention_kernel.attention(roped, k_written, v_written, groups, table, scale, None, write_rows,
                                          splits=2, min_span=attention_kernel.KEY_TILE, kv_scales=scales)
    got = attention_kernel.attention(q, k_codes, v_codes, groups, table, scale, None, write_rows, splits=2,
                                     min_span=attention_kernel.KEY_TILE, kv_scales=scales,
                                     rope=attention_kernel.Rope(k, v, cos, sin, positions))
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    for ours, theirs in ((k_codes, k_written), (v_codes, v_written)):  # the null page 0 takes the padding's
        assert torch.equal(ours[1:].view(torch.uint8), theirs[1:].view(torch.uint8))


LONG_PROMPT = [(i * 37) % 1100 + 10 for i in range(100)]  # two prefill chunks: the second reads the first's pages


def _engine_run(model: Path, monkeypatch, kv_cache_dtype: str):
    """Greedy tokens of two short prompts, and the long prompt's logprobs of its own tokens, teacher-forced."""
    monkeypatch.setenv("BLINK_KERNELS", "triton")
    llm = LLM(str(model), max_num_seqs=4, max_num_batched_tokens=96, num_pages=48, page_size=8,
              max_model_len=128, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate([list(range(3, 8)), [7] * 17, LONG_PROMPT],
                        [greedy, greedy, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)])
    return [o.token_ids for o in outs[:2]], outs[2].prompt_logprobs[1:], llm


def test_an_engine_with_fp8_pages_generates_what_bfloat16_pages_do(checkpoint, monkeypatch, tmp_path):
    """Close, not equal: greedy agreement over short outputs, and the long prompt's logprobs (the same context for
    both) within FP8's noise. The random model's top tokens are often within 0.05 of the next (bfloat16 against
    float32 flips some too), so agreement is counted, not required everywhere. The checkpoint carries per-layer
    scales (amax / 448 of the bfloat16 run's pages), as an FP8 checkpoint would, which the engine reads."""
    source = checkpoint("qwen2")
    base, base_logprobs, llm = _engine_run(source, monkeypatch, "auto")
    pool = llm.engine.pool
    amax = torch.stack([torch.stack([pool.k[i].abs().amax(), pool.v[i].abs().amax()]).float()
                        for i in range(pool.k.shape[0])])
    shutil.copytree(source, tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(weights))
    for i, (k_amax, v_amax) in enumerate(amax.tolist()):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_amax / 448)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_amax / 448)
    save_file(tensors, str(weights), metadata={"format": "pt"})

    got, got_logprobs, llm = _engine_run(tmp_path / "model", monkeypatch, "fp8")
    pool = llm.engine.pool
    assert pool.k.dtype == pool.v.dtype == torch.float8_e4m3fn and pool.fp8
    torch.testing.assert_close(pool.scales.cpu(), amax / 448)
    assert llm.engine.model.layers[0].kv_scales.data_ptr() == pool.scales[0].data_ptr()
    assert pool.k.float().abs().amax() > 100  # pages written at their scale, not at 1.0
    agree = sum(a == b for x, y in zip(base, got, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.75 * sum(len(x) for x in base), (base, got)
    assert base[0][:4] == got[0][:4] and base[1][:4] == got[1][:4]
    drift = torch.tensor([abs(b[t].logprob - g[t].logprob)
                          for b, g, t in zip(base_logprobs, got_logprobs, LONG_PROMPT[1:], strict=True)])
    assert drift.max() < 0.5 and drift.mean() < 0.12, (drift.max(), drift.mean())
    top = [max(b.items(), key=lambda e: e[1].logprob)[0] == max(g.items(), key=lambda e: e[1].logprob)[0]
           for b, g in zip(base_logprobs, got_logprobs, strict=True)]
    assert sum(top) >= 0.8 * len(top)


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_fp8_pages_are_refused_where_the_kernels_cannot_read_them(kernels, checkpoint, monkeypatch):
    monkeypatch.setenv("BLINK_KERNELS", kernels)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 .*Triton kernels.*GPU.*BLINK_KERNELS=triton"):
        LLM(str(checkpoint("qwen2")), num_pages=16, kv_cache_dtype="fp8")


def test_the_choice_is_checked_and_the_default_device_refuses_it_without_a_gpu(monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int8").validate()
    monkeypatch.delenv("BLINK_KERNELS", raising=False)
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_dtype.check("fp8_e5m2", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kv_dtype.check("fp8", torch.device("cuda"))  # the Triton kernels run there
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "an A100")
    with pytest.raises(ValueError, match=r"compute capability 8\.9\+"):
        kv_dtype.check("fp8", torch.device("cuda"))
    monkeypatch.setenv("BLINK_KERNELS", "triton")
    kv_dtype.check("fp8", torch.device("cpu"))  # the interpreter, for tests
    kv_dtype.check("auto", torch.device("cpu"))
    assert kv_dtype.storage("fp8", torch.bfloat16) == kv_dtype.storage("fp8_e4m3", torch.float32)
    assert kv_dtype.storage("auto", torch.bfloat16) == torch.bfloat16


def _config(layers: int = 2) -> SimpleNamespace:
    """What the pool reads of a ModelConfig."""
    return SimpleNamespace(num_layers=layers, num_kv_heads=2, head_dim=8, kv_size=16, dtype=torch.bfloat16)


def test_fp8_pages_take_half_the_bytes(monkeypatch):
    cfg = _config()
    assert PagePool.bytes_per_page(cfg, 16, torch.float8_e4m3fn) * 2 == PagePool.bytes_per_page(cfg, 16)
    pool = PagePool(cfg, 4, 16, torch.device("cpu"), kv_dtype=torch.float8_e4m3fn)
    assert pool.page_bytes * 2 == PagePool.bytes_per_page(cfg, 16) and pool.k.element_size() == 1
    assert torch.equal(pool.scales, torch.ones(2, 2))
    assert not PagePool(cfg, 4, 16, torch.device("cpu")).fp8


def test_the_checkpoints_scales_are_read(tmp_path):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
               "model.layers.2.self_attn.kv_scale": torch.tensor(3.0),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    scales = kv_dtype.checkpoint_scales(tmp_path, 4)
    assert scales.tolist() == [[0.5, 0.25], [1.0, 1.0], [3.0, 3.0], [1.0, 1.0]]
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor(0.0)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="finite and positive"):
        kv_dtype.checkpoint_scales(tmp_path, 4)


def test_the_rotation_mirror_moves_fp8_pages_as_they_are():
    cfg = _config()
    pool = PagePool(cfg, 6, 4, torch.device("cpu"), kv_dtype=torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(5)
    for half in (pool.k, pool.v):
        half.view(torch.uint8).copy_(torch.randint(0, 120, half.shape, generator=gen, dtype=torch.uint8))
    before = pool.k[:, 2].clone(), pool.v[:, 2].clone()
    mirror = HostMirror(pool, 4)
    assert mirror.data[0].dtype == torch.uint8  # the pages' bytes
    out = PageMoves(torch.tensor([2]), torch.tensor([3]), torch.tensor([0]), torch.tensor([0]))
    mirror.begin(out, 1, 0)
    back = PageMoves(torch.tensor([0]), torch.tensor([0]), torch.tensor([3]), torch.tensor([5]))
    mirror.begin(back, 0, 1)
    mirror.end()
    for moved, kept in zip((pool.k[:, 5], pool.v[:, 5]), before, strict=True):
        assert torch.equal(moved.view(torch.uint8), kept.view(torch.uint8))
