"""The commit's settle on the CPU, in C++ (cpu_commit.cpp): `settle` stands in for blink.engine.core.commit.settle and
`settle_runs` for blink.engine.core.speculation.Speculation.settle (taking the speculation first, as the device step's
blink.engine.kernels.commit.settle_runs does), each one call in place of the reference's ~60-90 small torch ops, with
its arguments, effects and output. tests/engine/test_commit_kernel.py and test_settle_runs_kernel.py hold them to the
references; tests/engine/test_cpu_commit.py runs them in an engine."""

from __future__ import annotations

import torch

from blink.engine.core.commit import EmittedRuns, StepOutput
from blink.engine.core.sampler import SampleOutput
from blink.engine.core.scheduler import StepPlan
from blink.engine.core.speculation import DECAY
from blink.engine.core.state import Slots, SlotStatus
from blink.engine.kernels import cpu
from blink.shared.slot_table import Finish

# The codes the C++ writes into the state, in settle_codes' order.
CODES = [SlotStatus.RUNNING, SlotStatus.FINISHED, Finish.STOP, Finish.LENGTH, Finish.ABORT]

_ops = None  # (settle_slots, settle_runs) once the library's codes were checked against CODES


def _kernels():
    global _ops
    if _ops is None:
        kernels = cpu.ops()
        codes = list(kernels.settle_codes())
        if codes != [int(c) for c in CODES]:
            raise cpu.Unavailable(f"cpu_commit.cpp's status and finish codes {codes} are not {CODES}: rebuild it")
        # The overloads themselves: a call skips the packet's overload lookup.
        _ops = kernels.settle_slots.default, kernels.settle_runs.default
    return _ops


def settle(state: Slots, plan: StepPlan, rows: int, out: SampleOutput, logits: torch.Tensor, eos_ids: torch.Tensor,
           count_outputs: bool) -> StepOutput:
    """blink.engine.core.commit.settle's arguments, effects and output."""
    token, reason, row_slot, *logprobs = _kernels()[0](
        plan.sample_slot, plan.sample_valid, rows, out.tokens, out.logprob, out.top_ids, out.top_logprobs, eos_ids,
        count_outputs, state.tokens, state.seq_len, state.output_counts, state.max_tokens, state.prompt_len,
        state.stop_ids, state.ignore_eos, state.status, state.cancel, state.finish_reason)
    logprob, top_ids, top_logprobs = logprobs or (None, None, None)
    return StepOutput(token=token, finish_reason=reason, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs,
                      row_slot=row_slot, row_logits=logits)


def settle_runs(speculation, state: Slots, plan: StepPlan, rows: int, out: SampleOutput, logits: torch.Tensor,
                eos_ids: torch.Tensor, count_outputs: bool) -> StepOutput:
    """blink.engine.core.speculation.Speculation.settle's arguments (the speculation first), effects and output."""
    first, reason, row_slot, tokens, count, *logprobs = _kernels()[1](
        plan.sample_slot, plan.sample_valid, plan.sample_token, plan.token_pos, rows, out.tokens, out.logprob,
        out.top_ids, out.top_logprobs, eos_ids, count_outputs, speculation.k, DECAY, state.tokens, state.seq_len,
        state.num_computed, state.draft_len, state.draft_n, state.output_counts, state.max_tokens, state.prompt_len,
        state.stop_ids, state.ignore_eos, state.status, state.cancel, state.finish_reason, state.spec_rate,
        state.spec_counts, state.spec_accepted_per_pos)
    logprob, top_ids, top_logprobs = logprobs or (None, None, None)
    return StepOutput(token=first, finish_reason=reason, logprob=None, top_ids=None, top_logprobs=None,
                      row_slot=row_slot, row_logits=logits,
                      runs=EmittedRuns(tokens, count, logprob, top_ids, top_logprobs))
