"""The CPU's C++ lay-out (blink.engine.kernels.cpu_lay_out) bound alone in an engine's step on the tiny model: the
same tokens as the torch reference (scheduler._lay_out), greedy and seeded, plain and with n-gram drafts (their runs
as decode rows, the CPU's attention), requests of different lengths, one ending early by a stop id, others by
max_tokens. tests/engine/test_lay_out_kernel.py holds it to the reference field by field."""

from __future__ import annotations

import os
import shutil

import pytest

from blink.engine import LLM, SamplingParams
from blink.engine.core.bookkeeping import TORCH_BOOKKEEPING, Bookkeeping
from blink.engine.core.scheduler import PlanKernels
from blink.engine.kernels import cpu_lay_out
from blink.engine.model.tiny_model import ensure_tiny_model
from tests.support.cpu_kernels import cpu_kernels_or_skip

pytestmark = pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("c++")),
                                reason="the CPU kernels are built with a C++ compiler, and none is on PATH")

# Prompts the tiny random model continues with repeats (drafts found and accepted), and one with none.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11], list(range(3, 70)), [4, 9]]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=160, dtype="float32")
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module", params=["plain", "drafts"])
def llm(request) -> LLM:
    cpu_kernels_or_skip()
    drafts = {"speculative_config": SPEC} if request.param == "drafts" else {}
    return LLM(str(ensure_tiny_model()), **ENGINE, **drafts)


def _run(llm: LLM, bookkeeping: Bookkeeping, params: list[SamplingParams]):
    llm.engine.step.use(bookkeeping)
    return [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, params)]


def test_the_c_plus_plus_lay_out_generates_the_reference_s_tokens(llm):
    calls = []

    def lay_out(*args, **kwargs):
        calls.append(args[6:])  # draft_rows and decode_runs, when the plan passes them
        return cpu_lay_out.lay_out(*args, **kwargs)

    mine = Bookkeeping(PlanKernels(lay_out=lay_out))
    greedy = _run(llm, TORCH_BOOKKEEPING, [SamplingParams(temperature=0, max_tokens=40)] * 4)
    stop = greedy[0][0][5]  # a token the first request generates: it ends there
    params = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=9), SamplingParams(temperature=0.9, seed=3, max_tokens=30),
              SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=17)]
    want = _run(llm, TORCH_BOOKKEEPING, params)
    assert want[0][1] == "stop" and len(want[0][0]) <= 6 and want[1][1] == "length"
    accepted = int(llm.engine.state.spec_counts[2])
    assert _run(llm, mine, params) == want
    assert calls
    if llm.engine.step.speculation is not None:  # the drafts' lay-out ran, as decode rows, and drafts were accepted
        assert all(args[0] > 0 and args[1] for args in calls)
        assert int(llm.engine.state.spec_counts[2]) > accepted
