"""The device step's contract as a test checks it: no read of a tensor's value on the host inside plan() and run(),
and no tensor made there on the default device (tests/engine/test_step.py, tests/engine/test_kernels.py)."""

from __future__ import annotations

import contextlib
import sys

import torch

from blink.engine.core import speculation, state


@contextlib.contextmanager
def host_reads_forbidden():
    """Makes every way of reading a tensor's value on the host raise, with the step as a device runs it: the host
    mode's skips (state.none_set), which read, turned off as they are on a GPU and under torch.compile. A Python
    number assigned into a tensor (`t[i] = 0`) raises too: torch copies it from the host, which a CUDA graph's
    capture refuses (fill_, index_fill_ or torch.where take a number without a copy). A tensor made without a device
    lands on the meta device here: on a GPU it would be a host tensor, which a capture refuses to copy, so mixing it
    with the step's tensors fails here too."""
    def refuse(*args, **kwargs):
        raise AssertionError("host read inside the step")

    setitem = torch.Tensor.__setitem__

    def assign(self, index, value):
        if isinstance(value, (bool, int, float)):
            raise AssertionError(f"a host number assigned into a tensor inside the step ({value!r}): a host copy")
        return setitem(self, index, value)

    names = ["item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"]
    saved = {n: getattr(torch.Tensor, n) for n in names}
    # Every module that took none_set by name (the plan's, the commit's, the prefix cache's...): all skip nothing.
    skips = {module: module.none_set for name, module in list(sys.modules.items())
             if name.startswith("blink.") and getattr(module, "none_set", None) is state.none_set}
    bound = speculation.host_bound
    for n in names:
        setattr(torch.Tensor, n, refuse)
    torch.Tensor.__setitem__ = assign
    for module in skips:
        module.none_set = lambda *masks: False
    speculation.host_bound = lambda x, top: top  # the drafts' search runs whole, as on a GPU
    try:
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        torch.Tensor.__setitem__ = setitem
        for module, f in skips.items():
            module.none_set = f
        speculation.host_bound = bound
