"""Which kernels stand in for the step's tensor bookkeeping (the plan's parts, the commit's settle, speculation's
draft and settle): a kernel set's choice, bound by `Step` for the host mode and by the device step for its own.

Each kernel takes its torch reference's arguments and has its effects, so a kernel set swaps them in whole and no
caller branches on which runs: the torch functions are the specification, and the tests hold each kernel to them.
The CPU's are C++ (engine/kernels/cpu_*.py: a step's hundreds of small torch ops cost about a millisecond of
dispatch there, an eighth of a small model's step); the device step's are Triton (engine/drive/device_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from blink.engine.core.scheduler import REFERENCE, PlanKernels


@dataclass(frozen=True)
class Bookkeeping:
    plan: PlanKernels = REFERENCE  # scheduler.plan's parts
    settle: Callable | None = None  # commit.settle
    advance: Callable | None = None  # commit.advance
    settle_runs: Callable | None = None  # Speculation.settle, taking the speculation first
    draft: Callable | None = None  # Speculation.draft, taking the speculation first


TORCH_BOOKKEEPING = Bookkeeping()  # the references themselves
