"""The device step's step-cost fit kernel (blink.engine.kernels.step_cost, in Triton's interpreter) keeps the same fit
as its torch reference (StepCostModel.observe_since) over a run of steps: the first, empty ones, naps, a clock that
does not move; and the host loop's fit on Python floats (HostStepCostModel) is the reference's, bit for bit."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernel

import random

import torch

from blink.engine.core.policy import HostStepCostModel, StepCost, StepCostModel
from blink.engine.kernels import step_cost


def test_the_kernel_fits_as_the_reference_does():
    rng = random.Random(3)
    models = [StepCostModel(StepCost(torch.device("cpu"))) for _ in range(2)]
    clocks = [(torch.zeros(1, dtype=torch.float64), torch.zeros((), dtype=torch.int64)) for _ in models]
    now = 100.0
    for i in range(60):
        tokens = rng.choice([0, 1, 16, 40, 256])
        now += rng.choice([0.0, 0.004 + 0.0001 * tokens * rng.uniform(0.9, 1.1), 3.0])  # none, a step, a nap
        clock = torch.tensor([now], dtype=torch.float64)
        models[0].observe_since(clock, clocks[0][0], clocks[0][1], 4.0)
        step_cost.observe_since(models[1], clock, clocks[1][0], clocks[1][1], 4.0)
        for _, last_tokens in clocks:
            last_tokens.fill_(tokens)
        expected, got = models[0], models[1]
        assert torch.allclose(got.sums, expected.sums, rtol=1e-12, atol=0), i
        assert torch.allclose(got.cost.values, expected.cost.values, rtol=1e-9, atol=1e-15), i
        assert torch.equal(clocks[0][0], clocks[1][0])
    assert models[0].sums[0] > 3 and models[0].cost.per_token > 0  # it learnt something


def test_the_host_loops_fit_is_the_references():
    rng = random.Random(5)
    reference, host = StepCostModel(StepCost(torch.device("cpu"))), HostStepCostModel(StepCost(torch.device("cpu")))
    for i in range(80):
        tokens = rng.choice([1, 2, 5, 16, 64])
        seconds = 0.006 + 0.0002 * tokens * rng.uniform(0.8, 1.2)
        valid = rng.random() > 0.1
        reference.observe(tokens, seconds, valid)
        host.observe(tokens, seconds, valid)
        assert reference.sums.tolist() == host.sums, i
        assert torch.equal(reference.cost.values, host.cost.values), i
    assert host.cost.per_token > 0 and host.cost.per_step > 0  # it learnt something
