"""The plan's lay-out kernel (blink.engine.kernels.lay_out, in Triton's interpreter) gives the plan the torch reference
(blink.engine.core.scheduler._lay_out) gives, field by field, padding included: steps of decodes, prompt chunks
longer than a query block, slots that compute nothing, an empty step, a full budget, with and without prompt
logprobs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernel

import dataclasses
import random

import torch

from blink.engine.core.scheduler import QueryRows, _lay_out
from blink.engine.core.state import Slots
from blink.engine.kernels.lay_out import lay_out


def _takes(rng: random.Random, S: int, T: int):
    yield [0] * S
    yield [1] * min(S, T) + [0] * (S - min(S, T))
    for _ in range(6):
        take = [rng.choice([0, 0, 1, 1, 2, 63, 64, 65, 130]) for _ in range(S)]
        while sum(take) > T:
            take[rng.randrange(S)] //= 2
        yield take
    yield [T] + [0] * (S - 1)


def test_the_kernel_lays_out_the_plan_as_the_reference_does():
    rng = random.Random(5)
    for S, T in ((4, 16), (8, 256), (5, 200)):
        state = Slots(S, 512, 40, 100, torch.device("cpu"))
        state.tokens.copy_(torch.randint(0, 100, state.tokens.shape, dtype=torch.int32))
        for take in _takes(rng, S, T):
            take = torch.tensor(take)
            state.num_computed.copy_(torch.tensor([rng.randrange(0, 300) for _ in range(S)]))
            state.seq_len.copy_(state.num_computed + take + torch.tensor([rng.choice([0, 0, 1]) for _ in range(S)]))
            moved = torch.tensor([rng.randrange(5), rng.randrange(5)])
            for entries in (None, torch.tensor([rng.randrange(3) for _ in range(S)])):
                expected = _lay_out(state, take, entries, None, moved, T)
                got = lay_out(state, take, entries, None, moved, T)
                for field in dataclasses.fields(expected):
                    want, have = getattr(expected, field.name), getattr(got, field.name)
                    if isinstance(want, QueryRows):
                        for part in dataclasses.fields(want):
                            assert torch.equal(getattr(have, part.name), getattr(want, part.name)), (
                                S, T, take, field.name, part.name)
                    elif isinstance(want, torch.Tensor):
                        assert torch.equal(have, want), (S, T, take, field.name)
                    else:
                        assert have is want, field.name
