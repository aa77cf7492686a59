"""The device step's contract as a test checks it: no read of a tensor's value on the host inside plan() and run()
(tests/engine/test_step.py, tests/engine/test_kernels.py)."""

from __future__ import annotations

import contextlib

import torch

from blink.engine.core import commit, scheduler, speculation


@contextlib.contextmanager
def host_reads_forbidden():
    """Makes every way of reading a tensor's value on the host raise, with the step as a device runs it: the host
    mode's skips (state.none_set), which read, turned off as they are on a GPU and under torch.compile."""
    def refuse(*args, **kwargs):
        raise AssertionError("host read inside the step")

    names = ["item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"]
    saved = {n: getattr(torch.Tensor, n) for n in names}
    skips = {module: module.none_set for module in (scheduler, commit, speculation)}
    bound = speculation.host_bound
    for n in names:
        setattr(torch.Tensor, n, refuse)
    for module in skips:
        module.none_set = lambda *masks: False
    speculation.host_bound = lambda x, top: top  # the drafts' search runs whole, as on a GPU
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        for module, f in skips.items():
            module.none_set = f
        speculation.host_bound = bound
