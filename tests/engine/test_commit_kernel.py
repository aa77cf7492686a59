"""The commit kernels settle a step as the torch reference (blink.engine.core.commit.settle) does: the Triton one
(blink.engine.kernels.commit, in Triton's interpreter) and the CPU's C++ one (blink.engine.kernels.cpu_commit). The
same state after it (the token history but its trash column for Triton's; the C++ writes the trash too) and the same
outputs, dtypes included, over random steps: rows that sample nothing, max_tokens 0, stop ids, eos (ignored or not),
the length limits, cancellations of running and of finished slots, with and without logprobs and output counts."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernel

import copy
import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from blink.engine.core.commit import settle
from blink.engine.core.sampler import SampleOutput
from blink.engine.core.state import Slots, SlotStatus
from blink.engine.kernels import commit as commit_kernel
from blink.engine.kernels import cpu_commit
from tests.support.cpu_kernels import cpu_kernels_or_skip

S, MAX_LEN, VOCAB, TOP = 8, 40, 30, 5


def _state(rng: random.Random) -> Slots:
    state = Slots(S, MAX_LEN, 8, VOCAB, torch.device("cpu"))
    draws = torch.Generator().manual_seed(rng.randrange(2**31))  # the same state for the same rng
    state.tokens.copy_(torch.randint(0, VOCAB, state.tokens.shape, dtype=torch.int32, generator=draws))
    state.prompt_len.copy_(torch.tensor([rng.randrange(1, 10) for _ in range(S)]))
    state.seq_len.copy_(state.prompt_len + torch.tensor([rng.choice([0, 3, 28, 30]) for _ in range(S)]))
    state.seq_len.clamp_(max=MAX_LEN - 1)
    state.max_tokens.copy_(torch.tensor([rng.choice([0, 4, 50]) for _ in range(S)]))
    state.stop_ids.copy_(torch.randint(-1, VOCAB, state.stop_ids.shape, generator=draws))
    state.ignore_eos.copy_(torch.tensor([rng.random() < 0.3 for _ in range(S)]))
    state.status.copy_(torch.tensor([rng.choice([SlotStatus.RUNNING] * 3 + [SlotStatus.FINISHED]) for _ in range(S)]))
    state.cancel.copy_(torch.tensor([rng.random() < 0.2 for _ in range(S)]))
    state.finish_reason.copy_(torch.randint(0, 3, (S,), generator=draws))
    state.output_counts.copy_(torch.randint(0, 3, state.output_counts.shape, dtype=torch.int32, generator=draws))
    return state


def cpp_kernels():
    """blink.engine.kernels.cpu_commit, or a skip saying why the CPU's kernels are not here."""
    cpu_kernels_or_skip()
    return cpu_commit


@pytest.mark.parametrize(("kernel", "trials"), [("triton", 12), ("cpp", 200)])  # the C++ is cheap: more steps
def test_the_kernel_settles_as_the_reference_does(kernel, trials):
    settle_kernel = commit_kernel.settle if kernel == "triton" else cpp_kernels().settle
    cut = -1 if kernel == "triton" else None  # the Triton kernel leaves the trash column be
    rng = random.Random(11)
    for trial in range(trials):
        rows = rng.choice([S, 4, 1] + ([0] if kernel == "cpp" else []))  # a step that samples nothing
        sampling = rng.sample(range(S), rng.randrange(0, rows + 1))
        slot = torch.tensor(sampling + [0] * (rows - len(sampling)), dtype=torch.int64)
        plan = SimpleNamespace(sample_slot=slot, sample_valid=torch.arange(rows) < len(sampling))
        logprobs, count = trial % 2 == 0, trial % 3 != 0
        out = SampleOutput(torch.randint(0, VOCAB, (rows,)), torch.randn(rows) if logprobs else None,
                           torch.randint(0, VOCAB, (rows, TOP)) if logprobs else None,
                           torch.randn(rows, TOP) if logprobs else None)
        eos = torch.tensor(rng.choice([[-1], [3], [3, 7, 11]]))
        logits = torch.randn(rows, VOCAB)
        seed = rng.randrange(1000)
        expected, got = _state(random.Random(seed)), _state(random.Random(seed))
        want = settle(expected, plan, rows, out, logits, eos, count)
        have = settle_kernel(got, plan, rows, out, logits, eos, count)
        for field in dataclasses.fields(want):
            a, b = getattr(want, field.name), getattr(have, field.name)
            assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype), (trial, field.name, a, b)
        for name, value in vars(expected).items():
            if isinstance(value, torch.Tensor):
                value, other = (value[:, :cut], getattr(got, name)[:, :cut]) if name == "tokens" else (
                    value, getattr(got, name))
                assert torch.equal(other, value), (trial, name)


@pytest.mark.parametrize("S", [1, 7, 64])
@pytest.mark.parametrize("with_entries", [True, False])
def test_the_kernel_advances_as_the_reference_does(S, with_entries):
    """commit.advance as a kernel: the tokens computed, the prompt positions scored, and what each slot had computed
    before the step."""
    from blink.engine.core.commit import advance

    gen = torch.Generator().manual_seed(S)
    state = Slots(S, 64, 8, 16, torch.device("cpu"))
    state.num_computed.copy_(torch.randint(0, 40, (S,), generator=gen))
    state.scored.copy_(torch.randint(0, 40, (S,), generator=gen))
    plan = SimpleNamespace(take=torch.randint(0, 5, (S,), generator=gen),
                           prompt_entries=torch.randint(0, 3, (S,), generator=gen) if with_entries else None)
    reference, scored = copy.deepcopy(state), state.scored.clone()
    want = advance(reference, plan)
    got = commit_kernel.advance(state, plan)
    assert torch.equal(got, want)
    assert torch.equal(state.num_computed, reference.num_computed) and torch.equal(state.scored, reference.scored)
    assert torch.equal(state.scored != scored, (plan.prompt_entries > 0) if with_entries else torch.zeros(S).bool())
