"""Which drive mode the engine runs: the best the machine supports, or the one asked for when it can; and the
driver (blink.engine.drive.driver.Driver) each mode is."""

from __future__ import annotations

import importlib.util

import torch

from blink.engine.drive.driver import Driver
from blink.engine.engine import Engine
from blink.engine.ranks import Ranks
from blink.shared.drive_modes import DRIVE_MODES
from blink.shared.slot_table import SlotTable

BEST_FIRST = DRIVE_MODES


def unavailable(mode: str, device: torch.device, tensor_parallel_size: int = 1,
                compile_bookkeeping: bool = False) -> str | None:
    """None when `mode` can run on `device` (over that many ranks, compiling the step's bookkeeping or not), else why
    not."""
    if mode == "host":
        # The device modes compile in their warm-up steps, before serving; the host mode would compile inside a
        # served step, half a minute without a heartbeat, and the watchdog would restart the engine.
        return ("--compile-bookkeeping compiles in the device modes' warm-up only (the host mode would compile "
                "inside a served step, which the watchdog takes for a stall)") if compile_bookkeeping else None
    if tensor_parallel_size > 1:
        return ("tensor parallelism runs in the host mode: the device step does not run collectives yet (NCCL "
                "captured in its graphs, built and checked on several GPUs)")
    if device.type != "cuda":
        return f"needs a CUDA device; the engine runs on {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "needs triton, which compiles the device step's kernels: pip install 'blink-serve[engine]'"
    if mode == "persistent":
        from blink.engine.drive.persistent import unavailable_reason

        return unavailable_reason()
    return None


def candidates(requested: str, device: torch.device, tensor_parallel_size: int = 1,
               compile_bookkeeping: bool = False) -> tuple[list[str], list[str]]:
    """The modes to try, best first, and why the modes passed over cannot run here. `auto` tries every mode, each
    falling back to the next when it fails to start; a mode asked for by name is the only candidate, so a result
    or a deployment is never labelled with a mode that did not run."""
    wanted = BEST_FIRST if requested == "auto" else (requested,)
    modes, reasons = [], []
    for mode in wanted:
        why = unavailable(mode, device, tensor_parallel_size, compile_bookkeeping)
        if why is None:
            modes.append(mode)
        else:
            reasons.append(f"{mode}: {why}")
    return modes, reasons


def build(mode: str, engine: Engine, table: SlotTable, ranks: Ranks | None = None) -> Driver:
    """The driver of `mode` over `table`, ready to start; raises when the mode cannot start here. ranks: the other
    ranks, with tensor parallelism (the host mode's only)."""
    if mode == "host":
        from blink.engine.drive.host import HostDriver

        return HostDriver(engine, table, ranks)
    from blink.engine.drive.device_step import DeviceStep

    step = DeviceStep(engine, table)
    try:
        if mode == "persistent":
            from blink.engine.drive.persistent import PersistentDriver

            return PersistentDriver(step, table)
        from blink.engine.drive.graph import GraphDriver

        return GraphDriver(step, table)
    except BaseException:
        step.close()
        raise
