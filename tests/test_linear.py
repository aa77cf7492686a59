"""The model's projections on the CPU: the split float32 product and packed bfloat16 weights give F.linear's
result, for decode and prefill row counts, with and without a bias."""

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
def test_packed_bfloat16_weights(rows):
    torch.manual_seed(rows)
    x, w, b = (torch.randn(*shape, dtype=torch.bfloat16) for shape in ((rows, 64), (96, 64), (96,)))
    assert can_pack(w) and not can_pack(w.float())
    packed = pack(w)
    for bias in (None, b):
        expected = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        torch.testing.assert_close(linear(x, packed, bias).float(), expected, rtol=2e-2, atol=2e-2)


def test_a_torch_without_the_packing_ops_runs_plain_products(monkeypatch):
    from blink.engine.model import linear as module

    def missing(*args):
        raise RuntimeError("no such op in this build")

    module._packed_products_work.cache_clear()
    monkeypatch.setattr(module, "pack", missing)
    try:
        assert not module.can_pack(torch.ones(4, 4, dtype=torch.bfloat16))
    finally:
        module._packed_products_work.cache_clear()
