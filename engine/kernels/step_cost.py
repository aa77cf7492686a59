"""The device step's step-cost fit as one Triton kernel: blink.engine.core.policy.StepCostModel.observe_since (the
torch reference, about fifty scalar ops, a kernel each in a captured step) in one launch of one program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core.policy import StepCostModel


@triton.jit
def _observe_since(now, last_now, last_tokens, values, sums, FORGET: tl.constexpr, NAP: tl.constexpr):
    previous = tl.load(last_now)
    current = tl.load(now)
    took = tl.where(previous > 0, current - previous, 0.0)
    tl.store(values + 2, took)  # since_last_plan
    last = tl.load(last_tokens)
    x = last.to(tl.float64)
    n, sx, sy = tl.load(sums), tl.load(sums + 1), tl.load(sums + 2)
    sxx, sxy = tl.load(sums + 3), tl.load(sums + 4)
    nap = (n >= 3) & (took > NAP * (tl.load(values) + tl.load(values + 1) * x))
    if (last > 0) & (took > 0) & ~nap:
        n = FORGET * n + 1.0
        sx = FORGET * sx + x
        sy = FORGET * sy + took
        sxx = FORGET * sxx + x * x
        sxy = FORGET * sxy + x * took
        tl.store(sums, n)
        tl.store(sums + 1, sx)
        tl.store(sums + 2, sy)
        tl.store(sums + 3, sxx)
        tl.store(sums + 4, sxy)
    var = n * sxx - sx * sx
    b = tl.where(var > 1e-9 * tl.maximum(n * sxx, 1.0), (n * sxy - sx * sy) / tl.maximum(var, 1e-300), 0.0)
    b = tl.maximum(b, 0.0)
    a = tl.maximum(tl.where(n > 0, (sy - b * sx) / tl.maximum(n, 1e-300), 0.0), 0.0)
    tl.store(values, a)
    tl.store(values + 1, b)
    tl.store(last_now, current)


def observe_since(model: StepCostModel, now: torch.Tensor, last_now: torch.Tensor, last_tokens: torch.Tensor,
                  nap_over: float) -> None:
    """StepCostModel.observe_since's arguments and effects."""
    _observe_since[(1,)](now, last_now, last_tokens, model.cost.values, model.sums, FORGET=model.forget,
                         NAP=nap_over)
