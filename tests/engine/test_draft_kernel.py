"""The drafts' proposal as kernels (blink.engine.kernels.draft.draft, in Triton's interpreter) against its torch
reference (Speculation.draft): the same drafts written after each sequence, draft lengths, acceptance rates and
returned lengths, for random slot states: several K and lookup ranges, histories with and without matches, slots that
may not or do not want to draft (not decoding, penalised, scoring their prompt, held off, below the threshold),
max_tokens, the context and the window's room meeting a draft, a budget spent before the drafts, too few free pages,
and each policy (the latency-sensitive slots' threshold)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernels

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from blink.engine.core.policy import StepCost, policy_named
from blink.engine.core.speculation import Speculation
from blink.engine.core.state import Slots
from blink.engine.kernels import draft as draft_kernels
from blink.engine.kernels.draft import draft
from blink.shared.speculative import MAX_LOOKUP

MAX_LEN, VOCAB = 48, 40
STATE = ("tokens", "draft_len", "draft_n", "spec_rate")


def _case(rng: random.Random, S: int, K: int, policy_name: str):
    """A plan's state when the drafts are proposed: slots decoding (some short of tokens, context or room), in a
    prefill chunk, or idle; the budget's order and cap; a pool of `page`-token pages."""
    state = Slots(S, MAX_LEN, 16, VOCAB, torch.device("cpu"))
    alphabet = rng.choice([2, 3, 5, VOCAB])  # a small one repeats: matches of every length
    state.tokens.copy_(torch.randint(0, alphabet, state.tokens.shape, dtype=torch.int32))
    page = rng.choice([4, 16])
    take, live = [], []
    for s in range(S):
        state.prompt_len[s] = rng.randrange(1, 12)
        seq = min(int(state.prompt_len[s]) + rng.randrange(0, 40), MAX_LEN - rng.choice([1, 1, 2, 3, 10, 30]))
        seq = max(seq, int(state.prompt_len[s]))
        state.seq_len[s] = seq
        kind = rng.choice(["decode"] * 6 + ["chunk", "idle"])
        n = {"decode": 1, "chunk": min(seq, rng.randrange(2, 6)), "idle": 0}[kind]
        state.num_computed[s] = seq - max(n, 1) if kind != "idle" else seq - rng.choice([0, 1])
        generated = seq - int(state.prompt_len[s])
        state.max_tokens[s] = rng.choice([generated + 1, generated + 2, generated + 3, 100, 100, 0])
        state.room[s] = rng.choice([1, 2, 3, MAX_LEN + 1, MAX_LEN + 1])
        state.spec_rate[s] = torch.tensor([rng.choice([1.0, 1.0, rng.random(), 0.1, 0.2]) for _ in range(MAX_LOOKUP)])
        state.draft_n[s] = rng.randrange(0, 4)  # the previous step's, which draft overwrites
        state.repetition_penalty[s] = 1.1 if rng.random() < 0.1 else 1.0
        state.presence_penalty[s] = 0.5 if rng.random() < 0.05 else 0.0
        state.frequency_penalty[s] = 0.5 if rng.random() < 0.05 else 0.0
        if rng.random() < 0.1:  # scoring its prompt
            state.prompt_logprobs[s] = 2
            state.scored[s] = rng.choice([0, int(state.prompt_len[s]) - 1])
        state.draft_off[s] = rng.random() < 0.1
        state.service_class[s] = rng.choice([0, 1])
        state.pages_held[s] = -(-int(state.num_computed[s]) // page) + rng.choice([0, 0, 1])
        state.draft_len[s] = rng.randrange(0, K + 1)  # the previous step's, which draft clears
        take.append(n)
        live.append(rng.random() < 0.9)
    take = torch.tensor(take)
    cost = StepCost(torch.device("cpu"))
    cost.values.copy_(torch.tensor(rng.choice([(0.0, 0.0, 0.0), (5e-3, 1e-5, 0.0), (1e-3, 2e-4, 0.0),
                                               (0.0, 1e-4, 0.0)]), dtype=torch.float64))
    spare = rng.choice([0, 1, 3, S * K, S * K])  # 0: the budget is spent before the drafts
    cap = take.sum() + spare
    pool = SimpleNamespace(page_size=page, num_free=torch.tensor(rng.choice([0, 1, 2, 5, 1000])))
    order = torch.randperm(S, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    return state, pool, policy_named(policy_name), cost, take, torch.tensor(live), order, cap


@pytest.mark.parametrize("block", [8, draft_kernels.HISTORY_BLOCK])  # a history in several blocks, and in one
@pytest.mark.parametrize("K,lookup", [(1, (1, 1)), (3, (1, 3)), (4, (2, 4)), (5, (3, 5))])
def test_the_kernels_draft_as_the_reference_does(K, lookup, block, monkeypatch):
    monkeypatch.setattr(draft_kernels, "HISTORY_BLOCK", block)
    rng = random.Random(K * 100 + lookup[0] + block)
    torch.manual_seed(rng.randrange(1 << 30))  # _case's histories: the same cases whichever tests ran before
    speculation = Speculation(K, *lookup, row_share=rng.choice([0.0, 0.37]))
    drafted = cut = retried = 0
    lengths = set()  # the match lengths drafts followed: each reads and settles its own column of spec_rate
    for case in range(24):
        S = rng.choice([1, 3, 8, 13])
        state, pool, policy, cost, take, live, order, cap = _case(rng, S, K, ["fcfs", "priority", "slo"][case % 3])
        theirs, roomy, rates = copy.deepcopy(state), copy.deepcopy(state), state.spec_rate.clone()
        want = speculation.draft(theirs, pool, policy, cost, take, live, order, cap)
        got = draft(speculation, state, pool, policy, cost, take, live, order, cap)
        for name in STATE:
            a, b = getattr(theirs, name), getattr(state, name)
            if name == "tokens":  # the reference writes what it does not draft into the trash column
                a, b = a[:, :MAX_LEN], b[:, :MAX_LEN]
            assert torch.equal(a, b), (case, name, a, b)
        assert torch.equal(got, want), (case, got, want)
        # What the cases met: drafts after matches of several lengths, drafts cut by the budget or the pages, slots
        # retrying.
        plenty = SimpleNamespace(page_size=pool.page_size, num_free=torch.tensor(1 << 20))
        uncut = speculation.draft(roomy, plenty, policy, cost, take, live, order, take.sum() + S * K)
        drafted += int((want > 0).sum())
        lengths |= set(theirs.draft_n[want > 0].tolist())
        cut += int(uncut.sum() > want.sum())
        retried += int((theirs.spec_rate != rates).sum())
    assert drafted > 0 and cut > 0 and retried > 0
    assert len(lengths) > 1 or lookup[0] == lookup[1], lengths


def draft_model_cases(seed: int, K: int, count: int):
    """A draft model's speculation (no lookup) and `count` plans' states to draft in, (case, speculation, _case's)."""
    rng = random.Random(seed)
    torch.manual_seed(rng.randrange(1 << 30))  # _case's tokens
    speculation = Speculation(K, 1, 1, lookup=False, row_share=0.37, draft_ratio=rng.choice([0.0, 0.33, 0.68, 1.0]))
    for case in range(count):
        S = rng.choice([1, 3, 8, 13])
        yield case, speculation, _case(rng, S, K, ["fcfs", "priority", "slo"][case % 3])


@pytest.mark.parametrize("K", [1, 4])
def test_a_draft_model_s_drafts_are_planned_as_the_reference_plans_them(K):
    """Without lookup (a draft model's): every slot that may draft offers K under its rate of column 0, and nothing is
    copied (the draft model writes the drafts in the step)."""
    drafted = 0
    for case, speculation, (state, pool, policy, cost, take, live, order, cap) in draft_model_cases(K + 7, K, 16):
        theirs = copy.deepcopy(state)
        want = speculation.draft(theirs, pool, policy, cost, take, live, order, cap)
        got = draft(speculation, state, pool, policy, cost, take, live, order, cap)
        for name in STATE:
            assert torch.equal(getattr(theirs, name), getattr(state, name)), (case, name)
        assert torch.equal(got, want), (case, got, want)
        drafted += int((want > 0).sum())
    assert drafted > 0
