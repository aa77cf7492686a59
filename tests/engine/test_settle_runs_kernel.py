"""The commit's settle with drafts as one kernel, the Triton one (blink.engine.kernels.commit.settle_runs, in Triton's
interpreter) and the CPU's C++ one (blink.engine.kernels.cpu_commit.settle_runs), against its torch reference
(Speculation.settle): the same state after it (tokens, lengths, KV rolled back, finishes,
counts, vLLM's counters, acceptance rates) and the same output, for steps mixing runs accepted whole, in part or not at
all, plain decodes and prompt chunks, with stop ids, eos, max_tokens and the context limit meeting a run, cancels, and
with and without logprobs and output counts."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernel

import copy
import random

import pytest
import torch

from blink.engine.core.sampler import SampleOutput
from blink.engine.core.scheduler import _lay_out
from blink.engine.core.speculation import Speculation
from blink.engine.core.state import Slots, SlotStatus
from blink.engine.kernels import commit
from blink.shared.speculative import MAX_LOOKUP
from tests.engine.test_commit_kernel import cpp_kernels

VOCAB, MAX_LEN = 40, 64
STATE = ("tokens", "seq_len", "num_computed", "draft_len", "draft_n", "output_counts", "status", "finish_reason",
         "spec_rate", "spec_counts", "spec_accepted_per_pos")


def _step(rng: random.Random, S: int, K: int):
    """A state after a step's forward (drafts written, num_computed advanced), its plan and its samples."""
    state = Slots(S, MAX_LEN, 40, VOCAB, torch.device("cpu"))
    state.tokens.copy_(torch.randint(0, VOCAB, state.tokens.shape, dtype=torch.int32))
    take = []
    for s in range(S):
        state.status[s] = SlotStatus.RUNNING
        state.prompt_len[s] = rng.randrange(2, 10)
        seq = state.prompt_len[s] + rng.randrange(0, 30)
        kind = rng.choice(["run", "run", "run", "decode", "chunk", "idle"])
        drafts = rng.randrange(1, K + 1) if kind == "run" else 0
        seq = min(int(seq), MAX_LEN - 1 - drafts)
        state.seq_len[s], state.draft_len[s] = seq, drafts
        state.max_tokens[s] = rng.choice([0, 1, 3, 5, 40, 40, 40])
        state.stop_ids[s, 0] = rng.randrange(VOCAB) if rng.random() < 0.5 else -1
        state.ignore_eos[s] = rng.random() < 0.3
        state.cancel[s] = rng.random() < 0.1
        state.spec_rate[s] = torch.rand(MAX_LOOKUP)
        state.draft_n[s] = rng.randrange(1, 4) if drafts else rng.randrange(0, 4)  # the match the drafts followed
        state.output_counts[s] = torch.randint(0, 3, (VOCAB,), dtype=torch.int32)
        n = {"run": 1 + drafts, "decode": 1, "chunk": rng.randrange(2, 6), "idle": 0}[kind]
        if kind == "chunk" and rng.random() < 0.5:
            state.seq_len[s] = seq + 1  # a prompt chunk short of its end: no sampling row
        state.num_computed[s] = seq + drafts - n
        take.append(n)
    take = torch.tensor(take)
    rows = Speculation(K, 1, 3).rows(S, 64)
    plan = _lay_out(state, take, None, None, torch.zeros(2, dtype=torch.int64), 64, rows, False)
    state.num_computed += take  # commit.advance, before the settle
    # Each row's draw: the draft after it most often (accepted), else another token.
    slot, pos = plan.sample_slot, plan.token_pos[plan.sample_token]
    draft = state.tokens[slot, (pos + 1).clamp(max=MAX_LEN)].long()
    tokens = torch.where(torch.rand(rows) < 0.75, draft, torch.randint(0, VOCAB, (rows,)))
    eos = torch.tensor([rng.randrange(VOCAB), rng.randrange(VOCAB)])
    out = SampleOutput(tokens, torch.randn(rows), torch.randint(0, VOCAB, (rows, 6)), torch.randn(rows, 6))
    return state, plan, rows, out, eos


@pytest.mark.parametrize(("kernel", "cases"), [("triton", 24), ("cpp", 150)])  # the C++ is cheap: more steps
@pytest.mark.parametrize("K", [3, 4])  # runs of a power of two, and not
def test_the_kernel_settles_runs_as_the_reference_does(kernel, cases, K):
    settle_runs = commit.settle_runs if kernel == "triton" else cpp_kernels().settle_runs
    cut = MAX_LEN if kernel == "triton" else None  # the C++ writes the trash column as the reference does
    rng = random.Random(K)
    speculation = Speculation(K, 1, 3)
    accepted = ended = 0
    for case in range(cases):
        S = rng.choice([1, 4, 7])
        state, plan, rows, out, eos = _step(rng, S, K)
        with_logprobs = case % 2 == 0
        if not with_logprobs:
            out = SampleOutput(out.tokens, None, None, None)
        count = case % 3 != 0
        logits = torch.randn(rows, VOCAB)
        theirs = copy.deepcopy(state)
        want = speculation.settle(theirs, plan, rows, out, logits, eos, count)
        got = settle_runs(speculation, state, plan, rows, out, logits, eos, count)
        for name in STATE:
            a, b = getattr(theirs, name), getattr(state, name)
            if name == "tokens":  # the reference writes its invalid rows into the trash column
                a, b = a[:, :cut], b[:, :cut]
            assert torch.equal(a, b), (case, name, a, b)
        for name in ("token", "finish_reason", "row_slot"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (case, name)
        for name in ("token", "count", "logprob", "top_ids", "top_logprobs"):
            a, b = getattr(want.runs, name), getattr(got.runs, name)
            assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype), (case, name, a, b)
        assert got.row_logits is logits
        accepted += int(state.spec_counts[2])
        ended += int((want.finish_reason != 0).sum())
    assert accepted > 0 and ended > 0
