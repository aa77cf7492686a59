"""The model's projections on the CPU: the split float32 product and packed float32 and bfloat16 weights give
F.linear's result, for decode and prefill row counts, with and without a bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blink.engine.model.linear import can_pack, linear, pack


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
    from blink.engine.model import linear as module

    def missing(*args):
        raise RuntimeError("no such op in this build")

    module._packed_products_work.cache_clear()
    monkeypatch.setattr(module, "pack", missing)
    try:
        assert not module.can_pack(torch.ones(4, 4, dtype=torch.bfloat16))
        assert not module.can_pack(torch.ones(4, 4))
    finally:
        module._packed_products_work.cache_clear()
