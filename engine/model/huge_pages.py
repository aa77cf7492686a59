"""CPU memory in 2 MiB pages, for what every decode step streams from memory: the weights and the KV pool.

A batch-1 decode step reads every weight once. In 4 KiB pages that is a TLB miss every 4 KiB, and in a virtual
machine each miss walks two page tables. Linux hands transparent huge pages, in the `madvise` mode most
distributions ship, only to memory that asks: an anonymous mapping advised MADV_HUGEPAGE, which torch's allocator
does not do unless THP_MEM_ALLOC_ENABLE is set before its first allocation. So the tensors that are streamed get a
mapping of their own, advised. Measured on the 2-core EPYC VM (AVX512-BF16), side by side in one process
(`blink bench projections`, `blocked` against `blocked-4k`): all the projections of a token of a 125M Llama 1.14x
as fast in bfloat16 at 1 row, 1.06x at 16; 1.03x and 1.02x in float32; a few percent to 15% from one sitting to
the next.

Tensors under 1 MiB stay in torch's memory, as do other devices' tensors, and all of them where the kernel has no
transparent huge pages (or they are `never`) or BLINK_HUGE_PAGES=0 says so.
"""

from __future__ import annotations

import functools
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
SMALLEST = HUGE_PAGE // 2  # less stays in torch's memory: its huge page would hold more padding than data
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_DEFRAG = Path("/sys/kernel/mm/transparent_hugepage/defrag")  # reported: what a fault in advised memory may do


def available() -> bool:
    """Whether tensors go to advised mappings: on Linux with transparent huge pages not `never`, unless
    BLINK_HUGE_PAGES=0 (for a host where khugepaged's and compaction's work is unwelcome)."""
    return why_not() is None


def why_not() -> str | None:
    """Why CPU tensors stay in 4 KiB pages here, or None when they get huge pages."""
    if os.environ.get("BLINK_HUGE_PAGES", "1") == "0":
        return "off: BLINK_HUGE_PAGES=0"
    return _kernel_refuses()


def describe() -> str:
    """What `blink doctor` says: the mode, and where it is on, the host's THP settings."""
    if (why := why_not()) is not None:
        return f"{why}: CPU weights and KV pool in 4 KiB pages"
    return (f"CPU weights and KV pool in 2 MiB pages, advised (transparent huge pages {_setting(THP_SETTING)}, "
            f"defrag {_setting(THP_DEFRAG)}); BLINK_HUGE_PAGES=0 turns it off")


@functools.cache
def _kernel_refuses() -> str | None:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this OS has no MADV_HUGEPAGE"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"the kernel offers no transparent huge pages ({THP_SETTING} is unreadable)"
    return "transparent huge pages are `never` on this host" if "[never]" in setting else None


def _setting(path: Path) -> str:
    """The bracketed choice of a THP setting file."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, in huge pages where it takes half of one or more."""
    mapped = _mapped(torch.Size(shape), dtype)
    return torch.empty(shape, dtype=dtype) if mapped is None else mapped


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, in huge pages on the CPU. Written now, though a fresh mapping reads as zeros: a page first touched
    inside a step would fault there (zeroing 2 MiB, compacting memory to find them) on the per-token path."""
    mapped = _mapped(torch.Size(shape), dtype) if device.type == "cpu" else None
    return torch.zeros(shape, dtype=dtype, device=device) if mapped is None else mapped.zero_()


def moved(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor copied into huge pages (contiguous); a small one, another device's, or any while huge pages are
    off, as it is."""
    mapped = _mapped(t.shape, t.dtype) if t.device.type == "cpu" and t.layout == torch.strided else None
    return t if mapped is None else mapped.copy_(t)


def _mapped(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor in a mapping of its own advised MADV_HUGEPAGE (zeros); None if small, or without huge pages."""
    nbytes = shape.numel() * dtype.itemsize
    if nbytes < SMALLEST or not available():
        return None
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # a page more: to align
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no mapping to be had, or a kernel built without THP: torch's memory, as elsewhere
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping for as long as a view of it lives
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)
