"""The model's projections on the CPU: the split float32 product, packed float32 and bfloat16 weights, the AVX-512
kernel over blocked weights and the AMX kernel give F.linear's result, for decode and prefill row counts, with and
without a bias; `prepare` picks the weight's form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blink.engine.model import linear as projections
from blink.engine.model.linear import amx_ops, block, blocked_ops, can_pack, linear, pack, prepare


@pytest.mark.parametrize("rows", [1, 3, 17, 130])
@pytest.mark.parametrize("out_features", [96, 97])  # 97: not divisible by the threads, the plain product
def test_float32_split_product(rows, out_features):
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 64), torch.randn(out_features, 64), torch.randn(out_features)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for bias in (None, b):
            torch.testing.assert_close(linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch built with oneDNN")
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights(rows, dtype):
    torch.manual_seed(rows)
    x, w, b = (torch.randn(*shape, dtype=dtype) for shape in ((rows, 64), (96, 64), (96,)))
    assert can_pack(w) and not can_pack(w.double()) and not can_pack(w.half())
    packed = pack(w)
    assert packed.is_mkldnn
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for bias in (None, b):
        expected = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        torch.testing.assert_close(linear(x, packed, bias).double(), expected, rtol=tolerance, atol=tolerance)


def test_a_torch_without_the_packing_ops_runs_plain_products(monkeypatch):
    def missing(*args):
        raise RuntimeError("no such op in this build")

    projections._packed_products_work.cache_clear()
    monkeypatch.setattr(projections, "pack", missing)
    try:
        assert not projections.can_pack(torch.ones(4, 4, dtype=torch.bfloat16))
        assert not projections.can_pack(torch.ones(4, 4))
    finally:
        projections._packed_products_work.cache_clear()


needs_amx = pytest.mark.skipif(amx_ops() is None, reason="needs a CPU with AMX tiles (Intel Sapphire Rapids or "
                               "later) and the CPU kernels built")


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 70])  # 70: two passes of four row blocks, the last one short
def test_amx_products(rows):
    torch.manual_seed(rows)
    x, w, b = (torch.randn(*shape, dtype=torch.bfloat16) for shape in ((rows, 96), (48, 96), (48,)))
    for bias in (None, b):
        expected = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = linear(x, prepare(w), bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
        torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2)  # bfloat16's rounding of the sum


@needs_amx
def test_amx_rows_are_independent_of_the_batch():
    torch.manual_seed(0)
    x, w = torch.randn(70, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    alone = torch.cat([linear(x[i:i + 1], w) for i in range(70)])
    assert torch.equal(linear(x, w), alone)  # each output sums its products in one order, whatever the rows


@needs_amx
def test_amx_weight_forms():
    assert not prepare(torch.ones(32, 64, dtype=torch.bfloat16)).is_mkldnn  # the kernel reads the plain weight
    assert prepare(torch.ones(40, 64, dtype=torch.bfloat16)).is_mkldnn  # not whole 16-row tiles: oneDNN's
    assert prepare(torch.ones(32, 64)).is_mkldnn  # float32: oneDNN's
    with pytest.raises(RuntimeError, match="whole tiles"):
        amx_ops().amx_linear(torch.ones(1, 64, dtype=torch.bfloat16), torch.ones(40, 64, dtype=torch.bfloat16), None)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch built with oneDNN")
def test_without_our_kernels_weights_are_packed(monkeypatch):
    monkeypatch.setattr(projections, "amx_ops", lambda: None)
    monkeypatch.setattr(projections, "blocked_ops", lambda dtype: None)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    packed = prepare(w)
    assert packed.is_mkldnn
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x, packed), F.linear(x, w), rtol=2e-2, atol=2e-2)


def test_a_cpu_without_amx_runs_no_tiles():
    from blink.engine.kernels import cpu

    try:
        ops = cpu.ops()
    except cpu.Unavailable as e:
        pytest.skip(str(e))
    if ops.amx_ready():
        pytest.skip("this CPU has AMX tiles")
    w = torch.ones(32, 64, dtype=torch.bfloat16)  # 32 outputs: not a whole block for the AVX-512 kernel either
    assert amx_ops() is None and prepare(w).is_mkldnn == can_pack(w)  # oneDNN's layout where it has one
    with pytest.raises(RuntimeError, match="no AMX tiles"):
        ops.amx_linear(torch.ones(1, 64, dtype=torch.bfloat16), w, None)


def needs_blocked(dtype: torch.dtype):
    return pytest.mark.skipif(blocked_ops(dtype) is None, reason=f"needs a CPU with AVX-512 products for {dtype} "
                              "(AVX512-BF16 for bfloat16) and the CPU kernels built")


BLOCKED_DTYPES = [pytest.param(dtype, marks=needs_blocked(dtype)) for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype", BLOCKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 70])  # the kernel takes rows 6 at a time: whole groups and tails
@pytest.mark.parametrize("inputs", [64, 2050])  # 2050: the k loop's chunks of 1024, the last one short
def test_blocked_products(dtype, rows, inputs):
    torch.manual_seed(rows)
    x, w, b = (torch.randn(*shape, dtype=dtype) for shape in ((rows, inputs), (128, inputs), (128,)))
    blocked = prepare(w)
    assert blocked.shape == (2, inputs // (2 if dtype == torch.bfloat16 else 1), 64, 2 if dtype == torch.bfloat16
                             else 1)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bfloat16: the output's rounding
    for bias in (None, b):
        expected = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = linear(x, blocked, bias)
        assert got.dtype == dtype and got.shape == (rows, 128)
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", BLOCKED_DTYPES)
def test_blocked_rows_are_independent_of_the_batch(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(70, 1100, dtype=dtype), block(torch.randn(64, 1100, dtype=dtype))
    alone = torch.cat([linear(x[i:i + 1], w) for i in range(70)])
    assert torch.equal(linear(x, w), alone)  # each output sums its products in one order, whatever the rows


@pytest.mark.parametrize("dtype", BLOCKED_DTYPES)
def test_blocked_weight_forms(dtype, monkeypatch):
    monkeypatch.setattr(projections, "amx_ops", lambda: None)  # the AMX kernel takes bfloat16 first where it runs
    assert prepare(torch.ones(128, 64, dtype=dtype)).dim() == 4  # whole blocks of 64 outputs: blocked
    assert prepare(torch.ones(96, 64, dtype=dtype)).dim() == 2  # not: oneDNN's (or plain) as before
    assert prepare(torch.ones(128, 64, dtype=torch.float16)).dim() == 2  # a dtype the kernel has no product for
    ops = blocked_ops(dtype)
    with pytest.raises(RuntimeError, match="laid out by linear"):
        ops.blocked_linear(torch.ones(1, 64, dtype=dtype), torch.ones(128, 64, dtype=dtype), None)
    with pytest.raises(RuntimeError, match="K = 64"):
        ops.blocked_linear(torch.ones(1, 32, dtype=dtype), block(torch.ones(128, 64, dtype=dtype)), None)
