"""The CPU's C++ drafts' proposal (blink.engine.kernels.cpu_draft.draft, cpu_draft.cpp) against its torch reference
(Speculation.draft): the same drafts written after each sequence, draft lengths, match lengths, acceptance rates (per
match length) and returned lengths for the random slot states the Triton twin's test draws
(tests/engine/test_draft_kernel.py), and in a whole engine on the tiny model, every call of its steps checked against
the reference and the text that of the reference's engine."""

from __future__ import annotations

import copy
import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core.bookkeeping import TORCH_BOOKKEEPING, Bookkeeping
from blink.engine.core.policy import StepCost, policy_named
from blink.engine.core.speculation import Speculation
from blink.engine.core.state import Slots
from blink.engine.kernels import cpu_draft
from blink.engine.model.tiny_model import ensure_tiny_model
from tests.engine.test_draft_kernel import STATE, _case, draft_model_cases
from tests.engine.test_speculation import ENGINE, PROMPTS, _spec
from tests.support.cpu_kernels import cpu_kernels_or_skip


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_kernels_or_skip()


def _same(reference: Slots, state: Slots, want: torch.Tensor, got: torch.Tensor, *where) -> None:
    for name in STATE:
        a, b = getattr(reference, name), getattr(state, name)
        if name == "tokens":  # the reference writes what it does not draft into the trash column; the kernel does not
            a, b = a[:, :-1], b[:, :-1]
        assert torch.equal(a, b), (*where, name, a, b)
    assert got.dtype == want.dtype and torch.equal(got, want), (*where, got, want)


@pytest.mark.parametrize("K,lookup", [(1, (1, 1)), (3, (1, 3)), (4, (2, 4)), (5, (3, 5)), (8, (1, 6))])
def test_the_kernel_drafts_as_the_reference_does(K, lookup):
    rng = random.Random(K * 100 + lookup[0])
    speculation = Speculation(K, *lookup, row_share=rng.choice([0.0, 0.37]))
    drafted = cut = retried = 0
    lengths, columns = set(), set()  # the match lengths drafted after, the rates' columns retried
    for case in range(120):
        S = rng.choice([1, 3, 8, 13, 40])
        state, pool, policy, cost, take, live, order, cap = _case(rng, S, K, ["fcfs", "priority", "slo"][case % 3])
        reference, roomy, rates = copy.deepcopy(state), copy.deepcopy(state), state.spec_rate.clone()
        want = speculation.draft(reference, pool, policy, cost, take, live, order, cap)
        got = cpu_draft.draft(speculation, state, pool, policy, cost, take, live, order, cap)
        _same(reference, state, want, got, case)
        # What the cases met: drafts, drafts cut by the budget or the pages, slots retrying.
        plenty = SimpleNamespace(page_size=pool.page_size, num_free=torch.tensor(1 << 20))
        uncut = speculation.draft(roomy, plenty, policy, cost, take, live, order, take.sum() + S * K)
        drafted += int((want > 0).sum())
        cut += int(uncut.sum() > want.sum())
        retried += int((reference.spec_rate != rates).sum())
        lengths |= set(reference.draft_n[want > 0].tolist())
        columns |= set((reference.spec_rate != rates).nonzero()[:, 1].tolist())
    assert drafted > 0 and cut > 0 and retried > 0
    # Every match length in the lookup range met: its drafts, and its own column's retry.
    assert lengths == set(range(lookup[0], lookup[1] + 1)) and columns == set(range(lookup[0] - 1, lookup[1]))


@pytest.mark.parametrize("K", [1, 4])
def test_a_draft_model_s_drafts_are_planned_as_the_reference_plans_them(K):
    """Without lookup (a draft model's): every slot that may draft offers K under its rate of column 0, and nothing is
    copied (the draft model writes the drafts in the step)."""
    drafted = 0
    for case, speculation, (state, pool, policy, cost, take, live, order, cap) in draft_model_cases(K, K, 60):
        reference = copy.deepcopy(state)
        want = speculation.draft(reference, pool, policy, cost, take, live, order, cap)
        got = cpu_draft.draft(speculation, state, pool, policy, cost, take, live, order, cap)
        _same(reference, state, want, got, case)
        drafted += int((want > 0).sum())
        assert set(reference.draft_n[want > 0].tolist()) <= {1}
    assert drafted > 0


def test_long_histories_find_the_latest_and_longest_match():
    """Histories of hundreds of tokens over a small alphabet (matches of every length, far back and near), beside
    slots that do not draft with longer ones (the reference searches only the drafting slots' length)."""
    rng = random.Random(7)
    S, max_len, K = 16, 600, 5
    drafted = 0
    for case in range(20):
        speculation = Speculation(K, rng.choice([1, 2]), rng.choice([3, 5]))
        state = Slots(S, max_len, 80, 50, torch.device("cpu"))
        state.tokens.copy_(torch.randint(0, rng.choice([2, 4, 50]), state.tokens.shape, dtype=torch.int32,
                                         generator=torch.Generator().manual_seed(case)))
        seq = torch.tensor([rng.randrange(2, max_len - 1) for _ in range(S)])
        state.seq_len.copy_(seq)
        state.prompt_len.copy_(seq // 2)
        state.num_computed.copy_(seq - 1)
        state.max_tokens.fill_(max_len)
        take = torch.ones(S, dtype=torch.int64)
        live = torch.tensor([rng.random() < 0.7 for _ in range(S)])
        state.pages_held.copy_(seq // 8 + 1)
        pool = SimpleNamespace(page_size=8, num_free=torch.tensor(1000))
        cost = StepCost(torch.device("cpu"))
        reference = copy.deepcopy(state)
        order = torch.randperm(S, generator=torch.Generator().manual_seed(case))
        cap = take.sum() + S * K
        policy = policy_named("fcfs")
        want = speculation.draft(reference, pool, policy, cost, take, live, order, cap)
        got = cpu_draft.draft(speculation, state, pool, policy, cost, take, live, order, cap)
        _same(reference, state, want, got, case)
        drafted += int(want.sum())
    assert drafted > 0


def test_bad_inputs_are_refused_by_name():
    speculation = Speculation(3, 1, 3)
    state, pool, policy, cost, take, live, order, cap = _case(random.Random(3), 4, 3, "fcfs")
    # Every slot decoding and drafting, so the fit meets the order.
    state.num_computed.copy_(state.seq_len - 1)
    state.max_tokens.fill_(100)
    state.spec_rate.fill_(1.0)
    for name, value in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                        ("prompt_logprobs", -1), ("draft_off", False)):
        getattr(state, name).fill_(value)
    ones = torch.ones(4, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="order must be a permutation"):
        cpu_draft.draft(speculation, state, pool, policy, cost, ones, ones.bool(), torch.tensor([0, 1, 2, 9]), cap)
    state.seq_len = state.seq_len.int()
    with pytest.raises(RuntimeError, match="seq_len must be Long"):
        cpu_draft.draft(speculation, state, pool, policy, cost, take, live, order, cap)


class Checked:
    """cpu_draft.draft as an engine binds it, each call held to the reference on a copy of the state it met."""

    def __init__(self):
        self.calls = self.drafts = 0

    def __call__(self, speculation, state, pool, policy, cost, take, live, order, cap):
        reference = copy.deepcopy(state)
        want = dataclasses.replace(speculation, draft_kernel=None).draft(reference, pool, policy, cost, take, live,
                                                                         order, cap)
        got = cpu_draft.draft(speculation, state, pool, policy, cost, take, live, order, cap)
        _same(reference, state, want, got, self.calls)
        self.calls += 1
        self.drafts += int(got.sum())
        return got


def test_an_engine_drafting_in_cpp_generates_the_reference_s_tokens():
    """Greedy and seeded sampling, requests of different lengths, one ended early by a stop id and one by
    max_tokens: the same tokens and finishes as the engine whose drafts the torch reference proposes."""
    reference = LLM(str(ensure_tiny_model()), **ENGINE, speculative_config=_spec(4, 1, 3))
    reference.engine.step.use(TORCH_BOOKKEEPING)
    llm = LLM(str(ensure_tiny_model()), **ENGINE, speculative_config=_spec(4, 1, 3))
    checked = Checked()
    llm.engine.step.use(Bookkeeping(draft=checked))
    greedy = [o.token_ids for o in reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    stop = greedy[0][5]
    prompts = [*PROMPTS, PROMPTS[0][:9]]
    for params in ([SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0, max_tokens=7),
                    SamplingParams(temperature=0, max_tokens=30), SamplingParams(temperature=0, max_tokens=20)],
                   [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop])] * 4,
                   [SamplingParams(temperature=0.7, top_k=8, max_tokens=20, seed=seed) for seed in range(4)]):
        want, got = reference.generate(prompts, params), llm.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert checked.calls > 0 and checked.drafts > 0
    assert int(llm.engine.state.spec_counts[2]) > 0  # drafts the C++ proposed were accepted
