"""Which drive mode the engine runs: the best the machine supports, or the one asked for when it can."""

from __future__ import annotations

import importlib.util

import torch

BEST_FIRST = ("persistent", "graph", "host")


def unavailable(mode: str, device: torch.device) -> str | None:
    """None when `mode` can run on `device`, else why not."""
    if mode == "host":
        return None
    if device.type != "cuda":
        return f"needs a CUDA device; the engine runs on {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "needs triton, which compiles the device step's kernels: pip install 'blink-serve[engine]'"
    if mode == "persistent":
        from blink.engine.persistent_drive import unavailable_reason

        return unavailable_reason()
    return None


def candidates(requested: str, device: torch.device) -> tuple[list[str], list[str]]:
    """The modes to try, best first (each falls back to the next when it fails to start), and why the modes that
    were passed over cannot run here."""
    wanted = BEST_FIRST if requested == "auto" else BEST_FIRST[BEST_FIRST.index(requested):]
    modes, reasons = [], []
    for mode in wanted:
        why = unavailable(mode, device)
        if why is None:
            modes.append(mode)
        else:
            reasons.append(f"{mode}: {why}")
    return modes, reasons
