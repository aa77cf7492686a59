"""The plan's lay-out kernels (blink.engine.kernels.lay_out, in Triton's interpreter, and the CPU's C++ twin,
blink.engine.kernels.cpu_lay_out) give the plan the torch reference (blink.engine.core.scheduler._lay_out) gives, field
by field, padding included: steps of decodes, prompt chunks
longer than a query block, slots that compute nothing, an empty step, a full budget, with and without prompt
logprobs; and steps with drafts (runs of 1 + k tokens beside prompt chunks), their runs laid out as prefill chunks or as
decode rows."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernel

import dataclasses
import random

import pytest
import torch

from blink.engine.core.scheduler import QueryRows, _lay_out
from blink.engine.core.state import Slots
from blink.engine.kernels import cpu_lay_out
from blink.engine.kernels import lay_out as triton_lay_out
from tests.support.cpu_kernels import cpu_kernels_or_skip


@pytest.fixture(params=["triton", "cpp"])
def lay_out(request):
    """The kernel under test, with the reference's arguments and plan."""
    if request.param == "cpp":
        cpu_kernels_or_skip()
        return cpu_lay_out.lay_out
    return triton_lay_out.lay_out


def _takes(rng: random.Random, S: int, T: int):
    yield [0] * S
    yield [1] * min(S, T) + [0] * (S - min(S, T))
    for _ in range(6):
        take = [rng.choice([0, 0, 1, 1, 2, 63, 64, 65, 130]) for _ in range(S)]
        while sum(take) > T:
            take[rng.randrange(S)] //= 2
        yield take
    yield [T] + [0] * (S - 1)


def _same(expected, got, *where) -> None:
    for field in dataclasses.fields(expected):
        want, have = getattr(expected, field.name), getattr(got, field.name)
        if isinstance(want, QueryRows):
            for part in dataclasses.fields(want):
                assert torch.equal(getattr(have, part.name), getattr(want, part.name)), (*where, field.name, part.name)
        elif isinstance(want, torch.Tensor):
            assert torch.equal(have, want), (*where, field.name)
        else:
            assert have is want, field.name


def test_the_kernel_lays_out_the_plan_as_the_reference_does(lay_out):
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
                _same(_lay_out(state, take, entries, None, moved, T), lay_out(state, take, entries, None, moved, T),
                      S, T, take)


def _with_drafts(rng: random.Random, state: Slots, T: int, K: int) -> torch.Tensor:
    """A step's take with drafts written into `state`: runs (1 + k tokens from the last committed one, k up to K),
    prompt chunks (the last one sampling or not), idle slots; within the budget T."""
    S = state.num_slots
    take, drafts, seq = [0] * S, [0] * S, [0] * S
    computed = [rng.randrange(1, 300) for _ in range(S)]
    for s in range(S):
        kind = rng.choice(["run", "run", "decode", "chunk", "idle"])
        if kind == "run":
            drafts[s] = rng.randrange(1, K + 1)
            take[s], seq[s] = 1 + drafts[s], computed[s] + 1
        elif kind == "decode":
            take[s], seq[s] = 1, computed[s] + 1
        elif kind == "chunk":
            take[s] = rng.choice([2, 63, 64, 65, 130])
            seq[s] = computed[s] + take[s] + rng.choice([0, 0, 1])
        else:
            seq[s] = computed[s] + 1
        while sum(take) > T:  # cut to the budget: a cut run is a plain decode of its first token, or nothing
            take[s] //= 2
            drafts[s] = max(0, take[s] - 1) if kind == "run" else 0
            if kind == "chunk":
                seq[s] = computed[s] + take[s] + 1
    state.num_computed.copy_(torch.tensor(computed))
    state.seq_len.copy_(torch.tensor(seq))
    state.draft_len.copy_(torch.tensor(drafts))
    return torch.tensor(take)


def test_the_kernel_lays_out_steps_with_drafts_as_the_reference_does(lay_out):
    """A sampling row per token of each run with drafts, in batch order (padding: batch token 0's slot); the runs
    either in prefill chunks (a GPU's attention) or each token a decode row (the CPU's), the chunks the rest."""
    rng = random.Random(11)
    K = 3
    several = 0  # steps where a slot sampled more than one row: drafts laid out
    for S, T in ((4, 16), (8, 256), (6, 20), (3, 512)):
        state = Slots(S, 512, 40, 100, torch.device("cpu"))
        state.tokens.copy_(torch.randint(0, 100, state.tokens.shape, dtype=torch.int32))
        rows = min(S * (1 + K), T)
        for case in range(10):
            take = _with_drafts(rng, state, T, K) if case else torch.zeros(S, dtype=torch.int64)
            moved = torch.tensor([rng.randrange(5), rng.randrange(5)])
            for entries in (None, torch.tensor([rng.randrange(3) for _ in range(S)])):
                for decode_runs in (False, True):
                    expected = _lay_out(state, take, entries, None, moved, T, rows, decode_runs)
                    got = lay_out(state, take, entries, None, moved, T, rows, decode_runs)
                    _same(expected, got, S, T, take, state.draft_len, decode_runs)
                    several += int(got.sample_valid.sum()) > int((take > 0).sum())
    assert several > 0


@pytest.fixture
def cpp_lay_out():
    cpu_kernels_or_skip()
    return cpu_lay_out.lay_out


@pytest.mark.parametrize("S, T", [(1, 1), (1, 64), (16, 8), (300, 4096)])
def test_the_c_plus_plus_kernel_lays_out_any_slots_and_budget_as_the_reference_does(cpp_lay_out, S, T):
    """One slot, a budget of one token, fewer tokens than slots, many slots (the C++ twin's loops; the interpreted
    Triton kernel is held to the shapes above)."""
    rng = random.Random(S * T)
    state = Slots(S, T + 320, 40, 100, torch.device("cpu"))
    state.tokens.copy_(torch.randint(0, 100, state.tokens.shape, dtype=torch.int32))
    moved = torch.tensor([1, 2])
    for take in _takes(rng, S, T):
        take = torch.tensor(take)
        state.num_computed.copy_(torch.tensor([rng.randrange(0, 300) for _ in range(S)]))
        state.seq_len.copy_(state.num_computed + take + torch.tensor([rng.choice([0, 0, 1]) for _ in range(S)]))
        state.draft_len.zero_()
        for entries in (None, torch.tensor([rng.randrange(3) for _ in range(S)])):
            _same(_lay_out(state, take, entries, None, moved, T), cpp_lay_out(state, take, entries, None, moved, T),
                  S, T, take)
    for _ in range(5):
        take, rows = _with_drafts(rng, state, T, 4), min(S * 5, T)
        for decode_runs in (False, True):
            _same(_lay_out(state, take, None, None, moved, T, rows, decode_runs),
                  cpp_lay_out(state, take, None, None, moved, T, rows, decode_runs), S, T, take, decode_runs)


def test_the_c_plus_plus_kernel_refuses_state_it_cannot_read(cpp_lay_out):
    state = Slots(4, 64, 8, 100, torch.device("cpu"))
    moved = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="take must be a contiguous int64 CPU tensor"):
        cpp_lay_out(state, torch.ones(4, dtype=torch.int32), None, None, moved, 16)
    state.num_computed[2] = 64  # its second token past the history's 65 columns
    with pytest.raises(RuntimeError, match="slot 2's position 65 is outside its tokens"):
        cpp_lay_out(state, torch.tensor([0, 1, 2, 0]), None, None, moved, 16)
