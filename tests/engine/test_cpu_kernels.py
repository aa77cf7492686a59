"""The CPU's C++ kernels (engine/kernels/cpu.cpp) against the torch reference, and how the engine picks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from blink.engine.core.scheduler import QUERY_BLOCK
from blink.engine.kernels import cpu
from blink.engine.model import kernel_sets
from blink.engine.model.attention import AttentionBatch, attend_groups, build_row_group
from blink.engine.model.attention import paged_attention as reference_attention
from blink.engine.model.kernel_sets import rms_norm
from blink.engine.model.rope import rotate, step_rope
from tests.support.kernel_inputs import SEQUENCES, rope_tables, scene

pytestmark = pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("c++")),
                                reason="the CPU kernels are built with a C++ compiler, and none is on PATH")


@pytest.fixture(scope="module")
def ops():
    return cpu.ops()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_the_reference(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(13, 96, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(96, generator=gen).to(dtype)
    # float32's sum of squares in another order: an ulp of the scale; bfloat16 rounds the same values alike, bar ties
    close = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2**-6, rtol=2**-7)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), **close)
    total, normed = ops.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, rms_norm(x + delta, weight, 1e-6), **close)
    heads = torch.randn(5, 12 * 16, generator=gen).to(dtype)[:, 16:112].unflatten(-1, (6, 16))  # q of a fused qkv
    torch.testing.assert_close(ops.rms_norm(heads, weight[:16], 1e-6), rms_norm(heads, weight[:16], 1e-6), **close)


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim"), [
    (torch.float32, 4, 2, 16), (torch.bfloat16, 4, 2, 16), (torch.bfloat16, 6, 2, 24)])
def test_rope_and_cache_are_the_reference_bit_for_bit(ops, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(1)
    B, num_pages, page_size = 19, 12, 4
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(B, q_size + 2 * kv_size, generator=gen).to(dtype)
    q, k, v = (part.unflatten(-1, (-1, head_dim)) for part in qkv.split([q_size, kv_size, kv_size], dim=-1))
    cos, sin = step_rope(*rope_tables(64, head_dim, dtype), torch.randint(0, 64, (B,), generator=gen))
    rows = torch.randperm(num_pages * page_size, generator=gen)[:B]
    k_cache, v_cache = (torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, kv_heads, head_dim)[rows] = rotate(k, cos, sin)
    expected_v.view(-1, kv_heads, head_dim)[rows] = v
    roped = ops.rope_and_cache(q, k, v, cos, sin, rows, k_cache, v_cache)
    assert torch.equal(roped, rotate(q, cos, sin))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_in_one_call_is_the_separate_ops_bit_for_bit(ops, dtype):
    """decode_step_attention (the fused projection's output in, the attention's out, rows of decodes only) and
    silu_and_mul give what the separate ops give, bit for bit, padding rows left zero."""
    kv_heads, group, head_dim, page_size = 2, 3, 16, 4
    q, k, v, k_cache, v_cache, table, write_rows, decode_rows, _ = (
        t.cpu() if isinstance(t, torch.Tensor) else t
        for t in scene([(37, 1), (5, 1), (63, 1), (64, 1)], page_size, kv_heads, group, head_dim, dtype))
    rows = type(decode_rows)(*(t.cpu() for t in vars(decode_rows).values()))
    B, heads = q.shape[0], kv_heads * group
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    cos, sin = step_rope(*rope_tables(128, head_dim, dtype), torch.randint(0, 128, (B,)))
    scale, args = head_dim ** -0.5, (table, rows.slot, rows.start, rows.first_pos, rows.count)
    caches = k_cache.clone(), v_cache.clone()
    roped = ops.rope_and_cache(q, k, v, cos, sin, write_rows, *caches)
    expected = q.new_zeros(B + 1, heads, head_dim)
    ops.decode_attention(roped, *caches, *args, scale, 0, expected)
    got = ops.decode_step_attention(qkv, heads, kv_heads, cos, sin, write_rows, k_cache, v_cache, *args, scale, 0)
    assert torch.equal(got, expected[:B]) and torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    assert not got[int(rows.count):].any()  # the scene's padding tokens: no row of theirs
    gate_up = torch.randn(5, 2 * 40).to(dtype)
    assert torch.equal(ops.silu_and_mul(gate_up), kernel_sets.silu_and_mul(gate_up))


def _check_attention(ops, sequences, page_size, kv_heads, group, dtype, window=None, head_dim=16):
    """Decode rows through the kernel, chunks through the reference's gathers, against the reference for all."""
    q, k, v, k_cache, v_cache, table, write_rows, decode_rows, chunk_rows = (
        t.cpu() if isinstance(t, torch.Tensor) else t
        for t in scene(sequences, page_size, kv_heads, group, head_dim, dtype))
    decode_rows, chunk_rows = (type(r)(*(t.cpu() for t in vars(r).values())) for r in (decode_rows, chunk_rows))
    B, scale, context = q.shape[0], head_dim ** -0.5, table.shape[1] * page_size
    groups = [build_row_group(rows, table, page_size, queries, context, window, B)
              for rows, queries in ((decode_rows, 1), (chunk_rows, QUERY_BLOCK)) if int(rows.count)]
    caches = k_cache.clone(), v_cache.clone()
    expected = reference_attention(q, k, v, *caches, AttentionBatch(write_rows, groups), scale)
    heads, dim = k_cache.shape[2:]
    k_cache.view(-1, heads, dim)[write_rows] = k
    v_cache.view(-1, heads, dim)[write_rows] = v
    out = q.new_zeros(B + 1, *q.shape[1:])
    ops.decode_attention(q, k_cache, v_cache, table, decode_rows.slot, decode_rows.start, decode_rows.first_pos,
                         decode_rows.count, scale, window or 0, out)
    attend_groups(q, k_cache, v_cache, groups[1:] if int(decode_rows.count) else groups, scale, out)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2**-7, rtol=2**-7)
    torch.testing.assert_close(out[:B], expected, **tolerance)


@pytest.mark.parametrize(("dtype", "page_size", "kv_heads", "group", "window", "head_dim"), [
    (torch.float32, 1, 2, 1, None, 16),
    (torch.float32, 4, 2, 2, None, 16),
    (torch.float32, 16, 1, 4, 10, 16),
    (torch.float32, 32, 2, 3, None, 24),
    (torch.bfloat16, 4, 2, 2, None, 16),
    (torch.bfloat16, 16, 2, 4, 24, 64),
    # head sizes with a vector path on AVX-512, query groups over more than one pass over the values
    (torch.float32, 4, 2, 5, None, 64),
    (torch.float32, 16, 1, 3, None, 128),
    (torch.bfloat16, 8, 2, 2, 10, 256),
    (torch.bfloat16, 16, 1, 1, None, 128),
])
def test_decode_attention_matches_the_reference(ops, dtype, page_size, kv_heads, group, window, head_dim):
    _check_attention(ops, [*SEQUENCES, (300, 1)], page_size, kv_heads, group, dtype, window, head_dim)


def test_decode_attention_refuses_what_the_cache_does_not_hold(ops):
    """A bad index is an error the engine reports, not a read past the pool."""
    q, k_cache = torch.randn(2, 4, 16), torch.randn(6, 4, 2, 16)
    table, out = torch.tensor([[1, 2], [3, 9]]), torch.zeros(3, 4, 16)  # page 9: past the pool
    rows = dict(slot=torch.tensor([0, 1]), token=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="page out of range"):
        ops.decode_attention(q, k_cache, k_cache, table, *rows.values(), torch.tensor([3, 5]), torch.tensor(2), 0.25,
                             0, out)
    with pytest.raises(RuntimeError, match="out of range"):  # a position past the table's pages
        ops.decode_attention(q, k_cache, k_cache, table, *rows.values(), torch.tensor([3, 8]), torch.tensor(2), 0.25,
                             0, out)
    ops.decode_attention(q, k_cache, k_cache, table, *rows.values(), torch.tensor([3, 5]), torch.tensor(1), 0.25, 0,
                         out)  # the row past `count` is not read


def test_the_cpu_takes_the_cpp_kernels_and_falls_back_saying_why(monkeypatch, caplog):
    monkeypatch.delenv("BLINK_KERNELS", raising=False)
    cfg = SimpleNamespace(sliding_window=None, dtype=torch.bfloat16, head_dim=64)  # what choosing reads of a config
    assert kernel_sets.choose(cfg, torch.device("cpu")).name == "cpu"
    wide = SimpleNamespace(sliding_window=None, dtype=torch.bfloat16, head_dim=cpu.MAX_HEAD_DIM * 2)
    assert kernel_sets.choose(wide, torch.device("cpu")).name == "torch"  # heads wider than the kernel's row

    def no_compiler():
        raise cpu.Unavailable("the CPU kernels could not be built (no compiler)")

    monkeypatch.setattr(cpu, "ops", no_compiler)
    assert kernel_sets.choose(cfg, torch.device("cpu")).name == "torch"
    assert "no compiler" in caplog.text and "torch reference" in caplog.text
    monkeypatch.setenv("BLINK_KERNELS", "cpu")  # asked for by name: no quiet fallback
    with pytest.raises(cpu.Unavailable):
        kernel_sets.choose(cfg, torch.device("cpu"))
    cfg.dtype = torch.float16  # what the C++ is not written for
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel_sets.choose(cfg, torch.device("cpu"))
    monkeypatch.delenv("BLINK_KERNELS")
    assert kernel_sets.choose(cfg, torch.device("cpu")).name == "torch"


def test_a_failed_build_is_tried_once_per_process(monkeypatch):
    tries = []

    def unwritable():
        tries.append(1)
        raise PermissionError("read-only cache")

    monkeypatch.setattr(cpu, "build_dir", unwritable)
    monkeypatch.setattr(cpu, "_loaded", None)  # as in a new process; the loaded kernels come back after the test
    for _ in range(2):
        with pytest.raises(cpu.Unavailable, match="read-only cache"):
            cpu.ops()
    assert len(tries) == 1


def test_a_load_killed_midway_leaves_nothing_that_blocks_the_next(ops, tmp_path):
    """A process killed inside torch's build step leaves torch's lock file behind; a new process loads anyway."""
    load = "from blink.engine.kernels import cpu; cpu.ops(); print('loaded')"
    if not cpu.build_dir().is_dir():  # `ops` may come from another cache: test_linear's skip conditions load the
        # kernels at collection, before conftest's BLINK_CACHE_DIR; a process of this session builds them here
        subprocess.run([sys.executable, "-c", load], check=True, capture_output=True, timeout=600)
    cache = tmp_path / "cache"
    built = cache / cpu.build_dir().relative_to(cpu.cache_root())
    shutil.copytree(cpu.build_dir(), built)  # the build as it stands, mtimes kept: nothing to rebuild
    (built / "lock").touch()  # what a SIGKILL between torch's acquire and release leaves
    done = subprocess.run([sys.executable, "-c", load], env={**os.environ, "BLINK_CACHE_DIR": str(cache)},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "loaded", done.stderr[-2000:]
    assert not (built / "lock").exists()
