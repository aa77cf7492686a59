"""The C++ settles (blink.engine.kernels.cpu_commit) in an engine: bound through Step.use, an engine on the tiny model
generates the tokens, logprobs and finish reasons the torch references give (greedy and seeded, requests of several
lengths, stop ids and max_tokens ending them early), plain and with drafts accepted; and bad state is refused by name.
test_commit_kernel.py and test_settle_runs_kernel.py hold them to the references step by step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core.bookkeeping import TORCH_BOOKKEEPING, Bookkeeping
from blink.engine.core.sampler import SampleOutput
from blink.engine.core.state import Slots
from blink.engine.model.tiny_model import ensure_tiny_model
from tests.engine.test_commit_kernel import cpp_kernels

# Prompts whose continuation the tiny random model repeats (so drafts are found and accepted), and longer ones.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11], list(range(3, 40)),
           [20, 21, 22, 23] * 5]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=128, dtype="float32")
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _calls(kernel, calls: list):
    def counted(*args):
        calls.append(kernel.__name__)
        return kernel(*args)
    return counted


def _generate(bookkeeping: Bookkeeping, spec: dict | None, params) -> tuple[list, torch.Tensor]:
    llm = LLM(str(ensure_tiny_model()), **ENGINE, **({"speculative_config": spec} if spec else {}))
    llm.engine.step.use(bookkeeping)
    outputs = llm.generate(PROMPTS, params)
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outputs], llm.engine.state.spec_counts.clone()


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "drafts"])
def test_an_engine_settling_in_cpp_generates_the_reference_s_tokens(spec):
    kernels, calls = cpp_kernels(), []
    cpp = Bookkeeping(settle=_calls(kernels.settle, calls), settle_runs=_calls(kernels.settle_runs, calls))
    greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    reference, _ = _generate(TORCH_BOOKKEEPING, spec, greedy)
    stop = reference[3][0][5]  # a token the last request emits a few tokens in: it ends there
    params = [greedy, SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0.8, top_k=8, seed=3,
                                                                                  max_tokens=20, logprobs=1),
              SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop])]
    want, want_counts = _generate(TORCH_BOOKKEEPING, spec, params)
    got, got_counts = _generate(cpp, spec, params)
    assert got == want
    assert [len(tokens) for tokens, _, _ in want] == [24, 6, 20, reference[3][0].index(stop) + 1]
    assert [reason for _, reason, _ in want] == ["length", "length", "length", "stop"]
    assert set(calls) == {"settle_runs" if spec else "settle"}  # every step settled in C++, none by the reference
    assert torch.equal(got_counts, want_counts)  # vLLM's drafts, draft tokens and accepted tokens
    if spec:
        assert int(want_counts[2]) > 0  # drafts were accepted, not only proposed


def test_bad_state_is_refused_by_name():
    kernels = cpp_kernels()
    state = Slots(2, 8, 2, 10, torch.device("cpu"))
    state.seq_len = state.seq_len.int()
    plan = SimpleNamespace(sample_slot=torch.tensor([0, 1]), sample_valid=torch.tensor([True, False]))
    out = SampleOutput(torch.tensor([3, 4]), None, None, None)
    with pytest.raises(RuntimeError, match="seq_len must be Long"):
        kernels.settle(state, plan, 2, out, torch.zeros(2, 10), torch.tensor([1]), False)
    state.seq_len = state.seq_len.long()
    plan.sample_slot = torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="slot 2 is not one of 2"):
        kernels.settle(state, plan, 2, out, torch.zeros(2, 10), torch.tensor([1]), False)
