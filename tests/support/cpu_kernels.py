"""The CPU's C++ kernels for a test that needs them, or a skip saying why they are not built here."""

from __future__ import annotations

import pytest

from blink.engine.kernels import cpu


def cpu_kernels_or_skip():
    """torch.ops.blink_cpu, built (or loaded) here; the test skips, with the reason, where they cannot be."""
    try:
        return cpu.ops()
    except cpu.Unavailable as e:
        pytest.skip(f"the CPU kernels are not built here: {e}")
