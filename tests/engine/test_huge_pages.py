"""The CPU's streamed tensors (weights, KV pool) in mappings the kernel may back with 2 MiB pages."""

import gc
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from blink.engine.core.kv_cache import PagePool
from blink.engine.model import huge_pages
from blink.engine.model.linear import blocked_takes, linear, prepare

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="needs Linux transparent huge pages (not `never`)")


def mapping_field(t: torch.Tensor, field: str) -> list[str]:
    """A field of the kernel's map of this process for the mapping holding t's data, as words."""
    at, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m[1], 16) <= at < int(m[2], 16)
        elif inside and line.startswith(field + ":"):
            return line.split()[1:]
    raise AssertionError(f"no mapping (or no {field} field) holds the tensor")


def thp_eligible(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's data was advised MADV_HUGEPAGE ("hg") and may take huge pages."""
    return "hg" in mapping_field(t, "VmFlags") and mapping_field(t, "THPeligible") == ["1"]


@needs_thp
def test_a_tensor_of_a_huge_page_or_more_lies_in_an_advised_aligned_mapping():
    t = huge_pages.empty((1024, 1024), torch.float32)  # 4 MiB
    assert t.shape == (1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert thp_eligible(t)


def test_a_copy_equals_its_source_and_outlives_everything_else():
    source = torch.randn(700, 1000)
    copy = huge_pages.moved(source)
    del source
    gc.collect()  # the mapping lives as long as a view of it
    copy.add_(1)
    assert torch.isfinite(copy).all() and copy.shape == (700, 1000)
    assert torch.equal(huge_pages.moved(copy), copy)
    assert torch.count_nonzero(huge_pages.zeros((3, 1 << 20), torch.bfloat16, torch.device("cpu"))) == 0


def test_small_tensors_and_the_switch_keep_torchs_memory(monkeypatch):
    small = torch.randn(64, 64)
    assert huge_pages.moved(small) is small
    big = torch.randn(1024, 1024)
    monkeypatch.setenv("BLINK_HUGE_PAGES", "0")
    assert not huge_pages.available()
    assert huge_pages.moved(big) is big
    assert huge_pages.describe() == "off: BLINK_HUGE_PAGES=0: CPU weights and KV pool in 4 KiB pages"


def test_doctor_says_what_the_host_offers(monkeypatch, tmp_path):
    huge_pages._kernel_refuses.cache_clear()
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "enabled")
    monkeypatch.setattr(huge_pages, "THP_DEFRAG", tmp_path / "defrag")
    try:
        (tmp_path / "enabled").write_text("always madvise [never]\n")
        assert not huge_pages.available() and "`never` on this host" in huge_pages.describe()
        huge_pages._kernel_refuses.cache_clear()
        (tmp_path / "enabled").write_text("always [madvise] never\n")
        (tmp_path / "defrag").write_text("always defer defer+madvise [madvise] never\n")
        assert huge_pages.available()
        assert "transparent huge pages madvise, defrag madvise" in huge_pages.describe()
        huge_pages._kernel_refuses.cache_clear()
        (tmp_path / "enabled").unlink()
        assert "offers no transparent huge pages" in huge_pages.describe()
    finally:
        huge_pages._kernel_refuses.cache_clear()


@needs_thp
def test_prepared_weights_and_the_kv_pool_lie_in_advised_memory():
    weight = torch.randn(1024, 768)
    prepared = prepare(weight)
    if blocked_takes(weight) or prepared.layout == torch.strided:  # oneDNN's packed weights are its own
        assert thp_eligible(prepared)
    x = torch.randn(3, 768)
    torch.testing.assert_close(linear(x, prepared), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    kv = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32)  # 2 MiB per cache
    pool = PagePool(kv, num_pages=256, page_size=16, device=torch.device("cpu"))
    assert thp_eligible(pool.k) and thp_eligible(pool.v)
    # resident from the start: a page first touched inside a step would fault on the per-token path
    assert int(mapping_field(pool.v, "Rss")[0]) * 1024 >= pool.v.nbytes
    assert torch.count_nonzero(pool.k) == 0


def test_a_mapping_refused_leaves_the_tensor_in_torchs_memory(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    big = torch.randn(1024, 1024)
    assert huge_pages.moved(big) is big
    assert torch.count_nonzero(huge_pages.zeros((1024, 1024), torch.float32, torch.device("cpu"))) == 0
