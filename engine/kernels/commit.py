"""The commit's per-slot part as one Triton kernel: blink.engine.core.commit.settle (the torch reference: tokens
appended and counted, stops, finish reasons, the rows' outputs scattered to their slots; about sixty small ops, a
kernel each in a captured step) in one launch, a program per slot; and `advance` (what the step computed: seven ops)
in one more. tests/engine/test_commit_kernel.py holds them to the references."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core.commit import StepOutput
from blink.engine.core.sampler import SampleOutput
from blink.engine.core.scheduler import StepPlan
from blink.engine.core.state import Slots, SlotStatus
from blink.shared.slot_table import Finish

RUNNING = tl.constexpr(int(SlotStatus.RUNNING))
FINISHED = tl.constexpr(int(SlotStatus.FINISHED))
STOP = tl.constexpr(int(Finish.STOP))
LENGTH = tl.constexpr(int(Finish.LENGTH))
ABORT = tl.constexpr(int(Finish.ABORT))


@triton.jit(do_not_specialize=["S"])
def _advance(take, entries, computed, scored, before, S, ENTRIES: tl.constexpr, BLOCK_S: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    real = s < S
    done = tl.load(computed + s, mask=real, other=0)
    if ENTRIES:
        e = tl.load(entries + s, mask=real, other=0)
        was = tl.load(scored + s, mask=real, other=0)
        tl.store(scored + s, tl.where(e > 0, tl.maximum(done, was) + e, was), mask=real)
    tl.store(computed + s, done + tl.load(take + s, mask=real, other=0), mask=real)
    tl.store(before + s, done, mask=real)


def advance(state: Slots, planned: StepPlan) -> torch.Tensor:
    """commit.advance's arguments, effects and result."""
    before = torch.empty_like(state.num_computed)
    entries = planned.prompt_entries
    _advance[(1,)](planned.take, planned.take if entries is None else entries, state.num_computed, state.scored,
                   before, state.num_slots, ENTRIES=entries is not None,
                   BLOCK_S=triton.next_power_of_2(state.num_slots))
    return before


@triton.jit
def _rows_of(s, r, sample_slot, sample_valid, row_slot, R):
    """Which of the rows `r` slot `s` sampled; program 0 also marks the rows that sampled nothing as no slot's."""
    rows = r < R
    row_sampled = tl.load(sample_valid + r, mask=rows, other=0) != 0
    if s == 0:
        tl.store(row_slot + r, -1, mask=rows & ~row_sampled)
    return row_sampled & (tl.load(sample_slot + r, mask=rows, other=-1) == s)


@triton.jit
def _settle(sample_slot, sample_valid, sampled_tokens, tokens, tokens_stride, seq_len, output_counts, vocab,
            max_tokens, prompt_len, stop_ids, ignore_eos, eos_ids, status, cancel, finish_reason,
            logprob, top_ids, top_logprobs, top_stride,
            token_out, reason_out, logprob_out, top_ids_out, top_logprobs_out, row_slot, R, E, max_len,
            COUNT: tl.constexpr, LOGPROBS: tl.constexpr, TOP: tl.constexpr, STOPS: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr):
    s = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    mine = _rows_of(s, r, sample_slot, sample_valid, row_slot, R)
    sampled = tl.max(mine.to(tl.int32), 0) != 0
    row = tl.sum(tl.where(mine, r, 0), 0)
    tok = tl.load(sampled_tokens + row, mask=sampled, other=0)
    # max_tokens 0 (the prompt's logprobs only): the row ends its request without a token.
    valid = sampled & (tl.load(max_tokens + s) > 0)
    n = tl.load(seq_len + s)
    if valid:
        tl.store(tokens + s.to(tl.int64) * tokens_stride + n, tok.to(tl.int32))
        n += 1
        tl.store(seq_len + s, n)
        if COUNT:
            counted = output_counts + s.to(tl.int64) * vocab + tok
            tl.store(counted, tl.load(counted) + 1)
    j = tl.arange(0, STOPS)
    stopped = tl.max((tl.load(stop_ids + s * STOPS + j) == tok).to(tl.int32), 0) != 0
    e = tl.arange(0, BLOCK_E)
    eos = tl.max((tl.load(eos_ids + e, mask=e < E, other=-1) == tok).to(tl.int32), 0) != 0
    stopped = stopped | (eos & (tl.load(ignore_eos + s) == 0))
    too_long = (n - tl.load(prompt_len + s) >= tl.load(max_tokens + s)) | (n >= max_len)
    reason = tl.where(stopped & valid, STOP, tl.where(too_long, LENGTH, 0))
    reason = tl.where(sampled, reason, 0).to(tl.int64)
    aborted = (tl.load(status + s) == RUNNING) & (tl.load(cancel + s) != 0) & (reason == 0)
    reason = tl.where(aborted, ABORT, reason)
    if reason != 0:
        tl.store(finish_reason + s, reason)
        tl.store(status + s, FINISHED)
    tl.store(reason_out + s, reason)
    tl.store(token_out + s, tl.where(valid & (reason != ABORT), tok, -1))  # aborts emit nothing
    if sampled:
        tl.store(row_slot + row, tl.where(valid, s, -1))
    if LOGPROBS:
        tl.store(logprob_out + s, tl.where(valid, tl.load(logprob + row, mask=sampled, other=0.0), 0.0))
        k = tl.arange(0, BLOCK_TOP)
        inside = k < TOP
        ids = tl.load(top_ids + row * top_stride + k, mask=inside & valid, other=-1)
        lps = tl.load(top_logprobs + row * top_stride + k, mask=inside & valid, other=0.0)
        tl.store(top_ids_out + s * TOP + k, ids, mask=inside)
        tl.store(top_logprobs_out + s * TOP + k, lps, mask=inside)


def _logprob_outputs(out: SampleOutput, shape: tuple[int, ...]):
    """The top's width, and where the rows' logprob ([*shape]), top ids and top logprobs ([*shape, top]) land per
    slot; (1, None, None, None) when the step computed no logprobs."""
    if out.logprob is None:
        return 1, None, None, None
    assert out.top_ids.stride() == out.top_logprobs.stride() and out.top_ids.stride(1) == 1
    top = out.top_ids.shape[1]
    return (top, out.logprob.new_empty(shape), out.top_ids.new_empty(*shape, top),
            out.top_logprobs.new_empty(*shape, top))


def settle(state: Slots, plan: StepPlan, rows: int, out: SampleOutput, logits: torch.Tensor, eos_ids: torch.Tensor,
           count_outputs: bool) -> StepOutput:
    """blink.engine.core.commit.settle's arguments, effects and output."""
    S, device = state.num_slots, state.status.device
    token, reason = torch.empty(S, dtype=out.tokens.dtype, device=device), torch.empty_like(state.finish_reason)
    row_slot = torch.empty(rows, dtype=plan.sample_slot.dtype, device=device)
    logprobs = out.logprob is not None
    top, logprob, top_ids, top_logprobs = _logprob_outputs(out, (S,))
    _settle[(S,)](plan.sample_slot, plan.sample_valid, out.tokens, state.tokens, state.tokens.stride(0), state.seq_len,
                  state.output_counts, state.output_counts.shape[1], state.max_tokens, state.prompt_len,
                  state.stop_ids, state.ignore_eos, eos_ids, state.status, state.cancel, state.finish_reason,
                  out.logprob, out.top_ids, out.top_logprobs, out.top_ids.stride(0) if logprobs else 0,
                  token, reason, logprob, top_ids, top_logprobs, row_slot, rows, eos_ids.shape[0], state.max_len,
                  COUNT=count_outputs, LOGPROBS=logprobs, TOP=top, STOPS=state.stop_ids.shape[1],
                  BLOCK_R=triton.next_power_of_2(rows), BLOCK_E=triton.next_power_of_2(eos_ids.shape[0]),
                  BLOCK_TOP=triton.next_power_of_2(top))
    return StepOutput(token=token, finish_reason=reason, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs,
                      row_slot=row_slot, row_logits=logits)


@triton.jit
def _settle_runs(sample_slot, sample_valid, sample_token, token_pos, sampled_tokens, tokens, tokens_stride, seq_len,
                 num_computed, draft_len, draft_n, output_counts, vocab, max_tokens, prompt_len, stop_ids, ignore_eos,
                 eos_ids, status, cancel, finish_reason, spec_rate, rates_stride, spec_counts, per_pos, POSITIONS,
                 logprob, top_ids, top_logprobs, top_stride, token_out, count_out, reason_out, logprob_out, top_ids_out,
                 top_logprobs_out, first_out, row_slot, R, E, max_len, DECAY, COUNT: tl.constexpr,
                 LOGPROBS: tl.constexpr, TOP: tl.constexpr, STOPS: tl.constexpr, RUN: tl.constexpr,
                 BLOCK_RUN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr):
    """One program per slot: its rows (a run, in position order) accepted up to the first whose token differs from
    the draft after it, emitted up to the first that ends the request (Speculation.settle)."""
    s = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    mine = _rows_of(s, r, sample_slot, sample_valid, row_slot, R)
    seq = tl.load(seq_len + s)
    k = tl.load(draft_len + s)
    i = tl.load(token_pos + tl.load(sample_token + r, mask=mine, other=0), mask=mine, other=0) - (seq - 1)
    i = tl.where(mine, i, 0)
    tok = tl.load(sampled_tokens + r, mask=mine, other=0)
    history = tokens + s.to(tl.int64) * tokens_stride
    draft_next = tl.load(history + tl.minimum(seq + i, max_len), mask=mine, other=-1).to(tok.dtype)
    breaks = mine & ((i >= k) | (tok != draft_next))  # the correction, or the bonus token
    j = tl.arange(0, STOPS)
    stopped = tl.max((tl.load(stop_ids + s * STOPS + j)[None, :] == tok[:, None]).to(tl.int32), 1) != 0
    e = tl.arange(0, BLOCK_E)
    eos = tl.load(eos_ids + e, mask=e < E, other=-1)
    stopped |= (tl.max((eos[None, :] == tok[:, None]).to(tl.int32), 1) != 0) & (tl.load(ignore_eos + s) == 0)
    n = seq + i + 1  # the sequence's length with the row's token
    too_long = (n - tl.load(prompt_len + s) >= tl.load(max_tokens + s)) | (n >= max_len)
    # Rows of a run in position order: a flag on an earlier row is one at a smaller i.
    first_break = tl.min(tl.where(breaks, i, RUN), 0)
    first_end = tl.min(tl.where(mine & (stopped | too_long), i, RUN), 0)
    live = mine & (i <= first_break) & (i <= first_end)
    valid = live & (tl.load(max_tokens + s) > 0)
    tl.debug_barrier()  # every draft read before a row's token overwrites it
    tl.store(history + tl.where(valid, seq + i, max_len), tok.to(tl.int32), mask=valid)
    emitted = tl.sum(valid.to(tl.int64), 0)
    if COUNT:
        tl.atomic_add(output_counts + s.to(tl.int64) * vocab + tok, valid.to(tl.int32), mask=valid)
    # vLLM's counters and the slot's acceptance rate for the match length its drafts followed.
    accepted = mine & (i < k) & (i < first_break)
    a = tl.sum(accepted.to(tl.int64), 0)
    if k > 0:
        tl.atomic_add(spec_counts, k * 0 + 1)
        tl.atomic_add(spec_counts + 1, k)
        tl.atomic_add(spec_counts + 2, a)
        rated = spec_rate + s.to(tl.int64) * rates_stride + tl.maximum(tl.load(draft_n + s) - 1, 0)
        rate = tl.load(rated)
        tried = tl.minimum(a + 1, k)  # the drafts tried: up to the first that failed
        tl.store(rated, DECAY * rate + (1 - DECAY) * tl.div_rn(a.to(tl.float32), tried.to(tl.float32)))
    tl.atomic_add(per_pos + tl.minimum(i, POSITIONS - 1), accepted.to(tl.int64), mask=accepted)

    row_reason = tl.where(stopped & valid, STOP, tl.where(too_long & live, LENGTH, 0))
    reason = tl.max(tl.where(live, row_reason, 0), 0).to(tl.int64)
    aborted = (tl.load(status + s) == RUNNING) & (tl.load(cancel + s) != 0) & (reason == 0)
    reason = tl.where(aborted, ABORT, reason)
    if k > 0:  # valid KV: the last committed token and the accepted drafts
        tl.store(num_computed + s, tl.load(num_computed + s) - tl.maximum(k + 1 - emitted, 0))
    tl.store(seq_len + s, seq + emitted)
    tl.store(draft_len + s, 0)
    if reason != 0:
        tl.store(finish_reason + s, reason)
        tl.store(status + s, FINISHED)
    tl.store(reason_out + s, reason)
    count = tl.where(reason == ABORT, 0, emitted)  # aborts emit nothing
    tl.store(count_out + s, count)
    tl.store(row_slot + r, tl.where(valid, s, -1), mask=mine)

    # The run's entries, [RUN] a slot: entry i is the row at offset i (fill where none).
    c = tl.arange(0, BLOCK_RUN)
    entry = c < RUN
    at = tl.where(valid & (i < RUN), i, BLOCK_RUN)  # one row per offset: the entry's row is the one sum picks
    hit = at[:, None] == c[None, :]  # [BLOCK_R, RUN]
    has = tl.max(hit.to(tl.int32), 0) != 0
    run_tok = tl.sum(tl.where(hit, tok[:, None], 0), 0)
    tl.store(token_out + s * RUN + c, tl.where(has, run_tok, -1), mask=entry)
    tl.store(first_out + s, tl.where(count > 0, tl.sum(tl.where(c == 0, tl.where(has, run_tok, -1), 0), 0), -1))
    if LOGPROBS:
        lp = tl.load(logprob + r, mask=mine, other=0.0)
        tl.store(logprob_out + s * RUN + c, tl.sum(tl.where(hit, lp[:, None], 0.0), 0), mask=entry)
        row_of = tl.sum(tl.where(hit, r[:, None], 0), 0)  # each entry's row (0 where none: masked below)
        t = tl.arange(0, BLOCK_TOP)
        inside = (t < TOP)[None, :]
        where = has[:, None] & inside
        ids = tl.load(top_ids + row_of[:, None] * top_stride + t[None, :], mask=where, other=-1)
        lps = tl.load(top_logprobs + row_of[:, None] * top_stride + t[None, :], mask=where, other=0.0)
        out_at = (s * RUN + c)[:, None] * TOP + t[None, :]
        tl.store(top_ids_out + out_at, ids, mask=inside & entry[:, None])
        tl.store(top_logprobs_out + out_at, lps, mask=inside & entry[:, None])


def settle_runs(speculation, state: Slots, plan: StepPlan, rows: int, out: SampleOutput, logits: torch.Tensor,
                eos_ids: torch.Tensor, count_outputs: bool) -> StepOutput:
    """blink.engine.core.speculation.Speculation.settle's arguments (the speculation first), effects and output."""
    from blink.engine.core.commit import EmittedRuns
    from blink.engine.core.speculation import DECAY

    S, device, run = state.num_slots, state.status.device, speculation.k + 1
    token, count = torch.empty(S, run, dtype=out.tokens.dtype, device=device), torch.empty_like(state.seq_len)
    first, reason = torch.empty(S, dtype=out.tokens.dtype, device=device), torch.empty_like(state.finish_reason)
    row_slot = torch.empty(rows, dtype=plan.sample_slot.dtype, device=device)
    logprobs = out.logprob is not None
    top, logprob, top_ids, top_logprobs = _logprob_outputs(out, (S, run))
    positions = state.spec_accepted_per_pos.shape[0]
    _settle_runs[(S,)](plan.sample_slot, plan.sample_valid, plan.sample_token, plan.token_pos, out.tokens,
                       state.tokens, state.tokens.stride(0), state.seq_len, state.num_computed, state.draft_len,
                       state.draft_n, state.output_counts, state.output_counts.shape[1], state.max_tokens,
                       state.prompt_len, state.stop_ids, state.ignore_eos, eos_ids, state.status, state.cancel,
                       state.finish_reason, state.spec_rate, state.spec_rate.stride(0), state.spec_counts,
                       state.spec_accepted_per_pos, positions,
                       out.logprob, out.top_ids, out.top_logprobs, out.top_ids.stride(0) if logprobs else 0,
                       token, count, reason, logprob, top_ids, top_logprobs, first, row_slot, rows, eos_ids.shape[0],
                       state.max_len, DECAY, COUNT=count_outputs, LOGPROBS=logprobs, TOP=top,
                       STOPS=state.stop_ids.shape[1], RUN=run, BLOCK_RUN=triton.next_power_of_2(run),
                       BLOCK_R=triton.next_power_of_2(rows),
                       BLOCK_E=triton.next_power_of_2(eos_ids.shape[0]), BLOCK_TOP=triton.next_power_of_2(top))
    return StepOutput(token=first, finish_reason=reason, logprob=None, top_ids=None, top_logprobs=None,
                      row_slot=row_slot, row_logits=logits,
                      runs=EmittedRuns(token, count, logprob, top_ids, top_logprobs))
