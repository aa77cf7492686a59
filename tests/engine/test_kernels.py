"""The Triton kernels against the torch reference (in Triton's interpreter without a GPU), and the engine's greedy
tokens with the Triton kernels against those with torch's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core.sampler import SamplerFeatures
from blink.engine.core.scheduler import QUERY_BLOCK, QueryRows
from blink.engine.kernels import attention as attention_kernel
from blink.engine.kernels import rms_norm as norm_kernel
from blink.engine.kernels import rope_kv as rope_kernel
from blink.engine.kernels.attention import paged_attention
from blink.engine.kernels.rms_norm import add_rms_norm, rms_norm
from blink.engine.kernels.rope_kv import rope_and_cache
from blink.engine.kernels.tickets import tickets
from blink.engine.model.attention import AttentionBatch, build_row_group
from blink.engine.model.attention import paged_attention as reference_attention
from blink.engine.model.kernel_sets import rms_norm as reference_rms_norm
from blink.engine.model.rope import apply_rope, rotate, step_rope
from tests.support.host_reads import host_reads_forbidden
from tests.support.kernel_inputs import DEVICE, SEQUENCES, rope_tables, scene
from tests.support.launches import Launches

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Elementwise kernels round as torch does: exact in float16. Triton 3.6's interpreter truncates when it narrows
# float32 to bfloat16 (the GPU rounds to nearest), so bfloat16 is allowed an ulp of values up to about 4 here.
ELEMENTWISE = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=0, rtol=0),
               torch.bfloat16: dict(atol=2**-5, rtol=2**-7)}

def _check_attention(sequences, page_size, kv_heads, group, dtype, window=None, head_dim=16, splits=None,
                     min_span=attention_kernel.MIN_SPAN):
    q, k, v, k_cache, v_cache, table, write_rows, decode_rows, chunk_rows = scene(
        sequences, page_size, kv_heads, group, head_dim, dtype)
    B, scale = q.shape[0], head_dim ** -0.5
    context = table.shape[1] * page_size
    groups = [build_row_group(rows, table, page_size, queries, context, window, B)
              for rows, queries in ((decode_rows, 1), (chunk_rows, QUERY_BLOCK)) if int(rows.count)]
    # The reference writes this step's K/V into the caches; the kernel then reads the same caches.
    expected = reference_attention(q, k, v, k_cache, v_cache, AttentionBatch(write_rows, groups), scale)
    out = torch.zeros_like(q)  # a group at a time: the other tokens are left alone
    paged_attention(q, k_cache, v_cache, decode_rows, 1, table, scale, window, out, splits, min_span)
    paged_attention(q, k_cache, v_cache, chunk_rows, QUERY_BLOCK, table, scale, window, out)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    # Both groups in one launch, into memory never zeroed: the padding tokens (no row's) get the reference's zeros.
    both = attention_kernel.attention(q, k_cache, v_cache, [(decode_rows, 1), (chunk_rows, QUERY_BLOCK)], table,
                                      scale, window, write_rows, out=torch.full_like(q, float("nan")),
                                      splits=splits, min_span=min_span)
    torch.testing.assert_close(both, expected, **TOLERANCE[dtype])
    assert not tickets("attention", q.device, 1).any()  # every span's ticket back at zero


@pytest.mark.parametrize(("page_size", "kv_heads", "group", "window", "head_dim"), [
    (1, 2, 1, None, 16),
    (4, 2, 2, None, 16),
    (16, 1, 4, 10, 16),
    (32, 2, 3, None, 24),  # a group and a head_dim that are not powers of two
    (128, 1, 2, 40, 16),  # pages longer than the key tile
])
def test_attention_matches_the_reference_in_float32(page_size, kv_heads, group, window, head_dim):
    _check_attention(SEQUENCES, page_size, kv_heads, group, torch.float32, window, head_dim)


@pytest.mark.parametrize(("dtype", "page_size", "group", "window"), [
    (torch.bfloat16, 4, 2, None), (torch.bfloat16, 16, 4, 24), (torch.float16, 8, 2, 7)])
def test_attention_matches_the_reference_in_16_bits(dtype, page_size, group, window):
    _check_attention(SEQUENCES, page_size, 2, group, dtype, window)


def test_attention_with_only_decodes_or_only_chunks():
    _check_attention([(9, 1), (30, 1), (0, 1)], 4, 2, 2, torch.float32)
    _check_attention([(0, 130), (50, 3)], 8, 2, 2, torch.float32)


@pytest.mark.parametrize(("splits", "dtype", "group", "window"), [
    (2, torch.float32, 2, None), (4, torch.float32, 3, 100), (16, torch.float32, 1, None),
    (4, torch.bfloat16, 4, None)])
def test_decode_rows_split_their_keys_and_match_the_reference(splits, dtype, group, window):
    """Flash-decoding: long and short contexts, so rows split into as many spans as their keys fill (of one key
    tile at least), and short ones into one; the last span of a row to finish merges them; beside chunks."""
    _check_attention([(300, 1), (37, 1), (0, 1), (130, 1), (0, 70), (5, 1)], 8, 2, group, dtype, window,
                     splits=splits, min_span=attention_kernel.KEY_TILE)


def test_decode_rows_split_only_as_far_as_the_live_rows_need(monkeypatch):
    """The spans a row takes are chosen on the device: with many live rows (programs for 8 wanted, 6 rows of 2 KV
    heads) no row splits and no span state is written; a lone row of 301 keys, allowed 4 spans, takes 3 of whole
    key tiles (128, 128, 45): no empty one is written or merged."""
    q, _, _, k_cache, v_cache, table, _, decode_rows, _ = scene([(300, 1)] * 6, 8, 2, 2, 16, torch.float32)
    made, state = [], attention_kernel._span_state
    monkeypatch.setattr(attention_kernel, "_span_state",
                        lambda *shape: made.append([t.fill_(float("nan")) for t in state(*shape)]) or made[-1])
    for wanted, rows, spans in ((8, 6, 0), (1024, 1, 3)):
        decode_rows.count.fill_(rows)
        monkeypatch.setattr(attention_kernel, "_programs", lambda device, wanted=wanted: wanted)
        out = attention_kernel.attention(q, k_cache, v_cache, [(decode_rows, 1)], table, 0.25, None, splits=4,
                                         min_span=attention_kernel.KEY_TILE)
        maxima = made[-1][0]  # [rows, heads, splits]
        assert int(maxima[:rows].isfinite().sum()) == rows * 4 * spans and not maxima[rows:].isfinite().any()
        single = attention_kernel.attention(q, k_cache, v_cache, [(decode_rows, 1)], table, 0.25, None, splits=1)
        at = decode_rows.start[:rows]
        torch.testing.assert_close(out[at], single[at])


@pytest.mark.parametrize(("dtype", "page_size", "group", "window", "splits"), [
    (torch.float32, 8, 2, None, 4), (torch.bfloat16, 4, 3, 24, 1), (torch.float16, 16, 1, None, 2)])
def test_attention_ropes_and_writes_the_cache_in_the_same_launch(dtype, page_size, group, window, splits):
    """A layer's attention in one launch: RoPE of q and k, the K/V cache write, decode rows (split) beside chunks
    whose earlier blocks' keys this same step computes, from strided views of one projection: the output and the
    caches of rope_and_cache followed by attention over the written cache."""
    sequences = [(300, 1), (37, 1), (0, 70), (100, 20), (5, 1), (15, 65), (63, 1)]
    head_dim, kv_heads = 16, 2
    q, k, v, k_cache, v_cache, table, write_rows, decode_rows, chunk_rows = scene(
        sequences, page_size, kv_heads, group, head_dim, dtype)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)  # as the projection lays them side by side
    q, k, v = qkv.unflatten(-1, (-1, head_dim)).split([kv_heads * group, kv_heads, kv_heads], dim=1)
    positions = torch.cat([torch.arange(done, done + take) for done, take in sequences] + [torch.zeros(3)]).long()
    cos, sin = (t.to(DEVICE) for t in rope_tables(512, head_dim, dtype))
    positions, scale = positions.to(DEVICE), head_dim ** -0.5
    groups = [(decode_rows, 1), (chunk_rows, QUERY_BLOCK)]
    k_written, v_written = k_cache.clone(), v_cache.clone()
    roped = rope_and_cache(q, k, v, cos, sin, positions, write_rows, k_written, v_written)
    expected = attention_kernel.attention(roped, k_written, v_written, groups, table, scale, window, write_rows,
                                          splits=splits, min_span=attention_kernel.KEY_TILE)
    # The step's keys come from the projection, whatever order the programs run in: the interpreter runs them in
    # order, so the chunks' blocks go last first, over cache rows that hold NaN until their writer comes.
    n = int(chunk_rows.count)
    groups[1] = (QueryRows(*(torch.cat([f[:n].flip(0), f[n:]]) for f in (chunk_rows.start, chunk_rows.length,
                                                                          chunk_rows.first_pos, chunk_rows.slot)),
                           chunk_rows.count), QUERY_BLOCK)
    real = write_rows[write_rows > 0]
    for cache in (k_cache, v_cache):
        cache.view(-1, kv_heads, head_dim)[real] = float("nan")
    got = attention_kernel.attention(q, k_cache, v_cache, groups, table, scale, window, write_rows,
                                     out=torch.full_like(roped, float("nan")), splits=splits,
                                     min_span=attention_kernel.KEY_TILE,
                                     rope=attention_kernel.Rope(k, v, cos, sin, positions))
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    # The same cache, bit for bit, but the null page 0 (where rope_and_cache sends the padding tokens' K/V).
    assert torch.equal(k_cache[1:], k_written[1:]) and torch.equal(v_cache[1:], v_written[1:])


def test_silu_and_mul_matches_the_reference():
    from blink.engine.kernels.activation import silu_and_mul
    from blink.engine.model.kernel_sets import silu_and_mul as reference

    gen = torch.Generator().manual_seed(3)
    for dtype, shape in ((torch.float32, (5, 2 * 40)), (torch.bfloat16, (3, 2 * 4100)), (torch.float16, (1, 64))):
        x = (torch.randn(shape, generator=gen) * 2).to(dtype).to(DEVICE)
        # Two narrowings (the silu, the product): in bfloat16 the interpreter's truncation may cost an ulp at each.
        tolerance = dict(atol=2**-4, rtol=2**-6) if dtype == torch.bfloat16 else ELEMENTWISE[dtype]
        torch.testing.assert_close(silu_and_mul(x), reference(x), **tolerance)


def test_the_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter runs kernels as Python; this compiles them for sm_90 (no GPU needed) so what only the
    compiler refuses fails in CI too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "tests.support.compile_for_gpu"], env=env, capture_output=True,
                          text=True, cwd=Path(__file__).parents[2], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_attention_of_an_empty_batch_touches_nothing():
    q, _, _, k_cache, v_cache, table, _, decode_rows, chunk_rows = scene(SEQUENCES, 4, 2, 2, 16, torch.float32)
    out = torch.full_like(q, 7.0)
    for rows, queries in ((decode_rows, 1), (chunk_rows, QUERY_BLOCK)):
        rows.count.zero_()  # the capacity keeps its junk rows
        paged_attention(q, k_cache, v_cache, rows, queries, table, 0.25, None, out)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim"), [
    (torch.float32, 4, 2, 16), (torch.bfloat16, 4, 2, 16), (torch.float16, 8, 8, 32),
    (torch.bfloat16, 6, 2, 24),  # half a head_dim that is not a power of two
])
def test_rope_and_cache_write_match_the_reference(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(1)
    B, padding, num_pages, page_size = 21, 4, 12, 4
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(B, q_size + 2 * kv_size, generator=gen).to(DEVICE, dtype)
    # Strided views of the fused projection, as the model hands them over.
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(B, heads, head_dim), k.view(B, kv_heads, head_dim), v.view(B, kv_heads, head_dim)
    cos, sin = rope_tables(64, head_dim, dtype)
    positions = torch.randint(0, 64, (B,), generator=gen)
    cos, sin, positions = cos.to(DEVICE), sin.to(DEVICE), positions.to(DEVICE)
    rows = (torch.randperm((num_pages - 1) * page_size, generator=gen)[:B] + page_size).to(DEVICE)  # not page 0
    rows[B - padding:] = 0  # padding tokens write the null page
    positions[B - padding:] = 0
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = apply_rope(q, cos[positions], sin[positions])
    real = slice(0, B - padding)
    expected_k.view(-1, kv_heads, head_dim)[rows[real]] = apply_rope(k, cos[positions], sin[positions])[real]
    expected_v.view(-1, kv_heads, head_dim)[rows[real]] = v[real]

    roped = rope_and_cache(q, k, v, cos, sin, positions, rows, k_cache, v_cache)
    torch.testing.assert_close(roped, expected_q, **ELEMENTWISE[dtype])
    torch.testing.assert_close(k_cache[1:], expected_k[1:], **ELEMENTWISE[dtype])  # page 0: the padding's writes
    torch.testing.assert_close(v_cache[1:], expected_v[1:], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_paths_rotation_is_transformers_bit_for_bit(dtype):
    """The CPU path rotates queries and keys together with one roll and a sign-folded sin: the same values as
    rotate_half's slices, negation and concatenation."""
    gen = torch.Generator().manual_seed(3)
    cos, sin = rope_tables(64, 24, dtype)
    positions = torch.randint(0, 64, (9,), generator=gen)
    x = torch.randn(9, 6, 24, generator=gen).to(dtype)
    assert torch.equal(rotate(x, *step_rope(cos, sin, positions)), apply_rope(x, cos[positions], sin[positions]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 80)])
def test_rms_norm_and_its_residual_add_match_the_reference(dtype, shape):
    gen = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    delta = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    x, delta, weight = x.to(DEVICE), delta.to(DEVICE), weight.to(DEVICE)
    # A float32 sum in another order may move a 16-bit result by an ulp.
    close = ELEMENTWISE[dtype] if dtype != torch.float16 else dict(atol=2**-8, rtol=2**-10)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6), **close)
    total, normed = add_rms_norm(x, delta, weight, 1e-6)
    torch.testing.assert_close(total, x + delta, **ELEMENTWISE[dtype])
    torch.testing.assert_close(normed, reference_rms_norm(x + delta, weight, 1e-6), **close)
    assert rms_norm(x[:0], weight, 1e-6).shape == x[:0].shape


def _moe(experts, top_k, hidden, inter, dtype, shared=False, seed=3):
    from blink.engine.model.config import MoeConfig
    from blink.engine.model.moe import MoeWeights

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)

    weights = MoeWeights(router=rand(experts, hidden, scale=1.0), gate_up=rand(experts, 2 * inter, hidden),
                         down=rand(experts, hidden, inter))
    if shared:
        weights.shared_gate_up, weights.shared_down = rand(2 * inter, hidden), rand(hidden, inter)
        weights.shared_gate = rand(1, hidden)
    config = MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=inter, normalize=True,
                       sparse_layers=(True,), naming="qwen", shared_intermediate_size=inter if shared else 0)
    return weights, config, rand(37, hidden, scale=1.0)


@pytest.mark.parametrize(("dtype", "experts", "top_k", "hidden", "inter", "shared"), [
    (torch.float32, 8, 2, 48, 40, False),  # sizes that are not powers of two, nor multiples of the tiles
    (torch.float32, 5, 1, 64, 96, True),  # top-1, a shared expert, more than one tile of the intermediate
    (torch.bfloat16, 6, 3, 32, 24, False),
])
def test_grouped_experts_match_the_torch_path(dtype, experts, top_k, hidden, inter, shared):
    from blink.engine.kernels import moe as moe_kernel
    from blink.engine.model.moe import grouped_moe_mlp, moe_mlp

    weights, config, h = _moe(experts, top_k, hidden, inter, dtype, shared)
    expected = moe_mlp(h, weights, config)
    got = grouped_moe_mlp(h, weights, config, moe_kernel)
    close = TOLERANCE[dtype] if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, expected, **close)


def test_copies_sorted_by_expert_fill_whole_blocks_of_one_expert():
    from blink.engine.model.moe import buffer_rows, sort_by_expert

    gen = torch.Generator().manual_seed(4)
    experts = torch.stack([torch.randperm(7, generator=gen)[:3] for _ in range(29)]).sort(dim=-1).values
    experts[experts == 5] = 6  # an expert nobody chose (its duplicates stay in id order)
    experts = experts.sort(dim=-1).values
    copies = sort_by_expert(experts, 7, 4)
    assert copies.token.shape == (buffer_rows(29, 3, 7, 4),) and buffer_rows(29, 3, 7, 4) % 4 == 0
    rows = copies.rows_of.flatten()
    assert rows.unique().numel() == rows.numel()  # one row per copy
    assert (copies.token[copies.rows_of] == torch.arange(29)[:, None]).all()  # each row copies its token
    assert (copies.block_expert[copies.rows_of // 4] == experts).all()  # in a block of its expert
    assert 5 not in copies.block_expert.tolist()
    used = copies.block_expert[copies.block_expert >= 0]
    assert (used.diff() >= 0).all() and (copies.block_expert[len(used):] == -1).all()  # experts in order, then unused


@pytest.mark.parametrize("kind", ["mistral", "qwen3", "qwen3-moe", "qwen2-moe"])  # a sliding window and GQA; q/k
# norms and head_dim 32; experts through the grouped kernel (top-2 with a dense layer; a shared expert)
@pytest.mark.parametrize("fused", ["triton", "cpu"])
def test_greedy_tokens_are_the_same_with_fused_kernels(kind, fused, checkpoint, monkeypatch):
    prompts = [list(range(3, 8)), list(range(10, 110)), list(range(200, 240)), [7] * 17]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1)
    results = {}
    for kernels in ("torch", fused):
        monkeypatch.setenv("BLINK_KERNELS", kernels)
        # A 96-token budget: the 100-token prompt prefills in two chunks, the first longer than QUERY_BLOCK, while
        # the others decode; 8-token pages make every row cross pages.
        llm = LLM(str(checkpoint(kind)), max_num_seqs=4, max_num_batched_tokens=96, num_pages=80, page_size=8,
                  max_model_len=128, dtype="float32")  # the tolerances below are float32's
        assert llm.engine.model.kernels.name == kernels
        results[kernels] = llm.generate(prompts, params)
    for torch_out, fused_out in zip(results["torch"], results[fused], strict=True):
        assert fused_out.token_ids == torch_out.token_ids
        for expected, got in zip(torch_out.logprobs, fused_out.logprobs, strict=True):
            assert got.keys() == expected.keys()
            for token, logprob in expected.items():
                assert got[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)


@pytest.mark.parametrize("kind", ["mistral", "qwen3-moe"])
def test_the_triton_path_reads_nothing_on_the_host(kind, checkpoint, monkeypatch):
    from blink.engine.kernels import moe as moe_kernel

    monkeypatch.setenv("BLINK_KERNELS", "triton")
    llm = LLM(str(checkpoint(kind)), max_num_seqs=4, max_num_batched_tokens=32, num_pages=40, page_size=8,
              max_model_len=64)
    log: list = []
    from blink.engine.kernels import activation as activation_kernel

    for module, name in ((attention_kernel, "_paged_attention_kernel"), (rope_kernel, "_rope_and_cache_kernel"),
                         (norm_kernel, "_rms_norm_kernel"), (moe_kernel, "_expert_product_kernel"),
                         (activation_kernel, "_silu_and_mul_kernel")):
        monkeypatch.setattr(module, name, Launches(name, getattr(module, name), log))
    driver = llm._driver
    for i, n in enumerate((3, 50)):
        driver.add_request(str(i), list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=4), 4)
    features = SamplerFeatures(penalties=False, filtering=False, random=False, logprobs=False)
    for _ in range(3):  # a chunk and a prompt's start, then a decode beside a chunk
        driver._fill_slots()
        with host_reads_forbidden():
            plan = llm.engine.step.plan(features, llm.engine.mirror)
        shape = llm.engine.step.shape_for(plan.read_sizes())
        with host_reads_forbidden():
            llm.engine.step.run(plan, shape, features, llm.engine.mirror)
    expected = {"_paged_attention_kernel", "_rms_norm_kernel"}  # RoPE and the cache write inside the attention
    expected |= {"_expert_product_kernel"} if "moe" in kind else set()
    expected |= {"_silu_and_mul_kernel"} if any(w.moe is None for w in llm.engine.model.layers) else set()
    assert {launch.name for launch in log} == expected
    assert all(isinstance(n, int) for launch in log for n in launch.grid)
