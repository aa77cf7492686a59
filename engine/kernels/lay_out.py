"""The plan's last part as one Triton kernel: blink.engine.core.scheduler._lay_out (the torch reference: the batch's
tokens flat, the decode, chunk and sampling rows, the sizes; about seventy small ops, a kernel each in a captured step)
in one launch. Programs 0..n-1 lay out a block of the batch's tokens each, the last one the rows and the sizes; each
takes the prefix sums of the slots' tokens itself. With drafts (engine/core/speculation.py) a sampling row per token
of each run from its last committed one on, and the runs' tokens laid out as decode rows where the attention asks for
that (decode_runs), by the token programs, which know each token's row. tests/engine/test_lay_out_kernel.py holds it
to the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core.scheduler import QUERY_BLOCK, PlanSizes, QueryRows, StepPlan, max_chunk_rows
from blink.engine.core.state import Slots

QB = tl.constexpr(QUERY_BLOCK)


@triton.jit
def _lay_out(take_ptr, computed_ptr, seq_len_ptr, draft_len_ptr, tokens, tokens_stride, entries, moved,
             token_slot, token_pos, token_valid, input_ids,
             decode_start, decode_length, decode_first, decode_slot,
             chunk_start, chunk_length, chunk_first, chunk_slot,
             sample_slot, sample_token, sample_valid, sizes,
             S, T, R, HAS_ENTRIES: tl.constexpr, PER_SLOT: tl.constexpr, MAX_CHUNKS: tl.constexpr,
             DRAFTS: tl.constexpr, RUNS: tl.constexpr,
             BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    real = s < S
    take = tl.load(take_ptr + s, mask=real, other=0)
    computed = tl.load(computed_ptr + s, mask=real, other=0)
    ends = tl.cumsum(take, 0)
    starts = ends - take
    total = tl.sum(take)
    seq = tl.load(seq_len_ptr + s, mask=real, other=0)
    if DRAFTS:  # a sampling slot's rows: its tokens from its last committed one on (1 + its drafts)
        drafts = tl.load(draft_len_ptr + s, mask=real, other=0)
        sampling = real & (take > 0) & (computed + take == seq + drafts)
        row_count = tl.where(sampling, computed + take - tl.maximum(computed, seq - 1), 0)
        row_first = tl.cumsum(row_count, 0) - row_count
        runs = real & (take > 0) & (take == 1 + drafts)  # decode_runs: a run's tokens are decode rows
        run_take = tl.where(runs, take, 0)
        run_first = tl.cumsum(run_take, 0) - run_take
    else:
        sampling = real & (take > 0) & (computed + take == seq)
        row_count = tl.where(sampling, 1, 0)
    block = tl.program_id(0)
    if block * BLOCK_T < T:  # a block of the batch's tokens, slot after slot
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = t < T
        # searchsorted(ends, t, right=True): the slots that end at or before t
        slot = tl.sum((ends[None, :] <= t[:, None]) & real[None, :], 1)
        slot = tl.minimum(slot, S - 1)
        at_slot = s[None, :] == slot[:, None]
        valid = t < total
        pos = tl.where(valid, tl.sum(tl.where(at_slot, computed[None, :] - starts[None, :], 0), 1) + t, 0)
        tl.store(token_slot + t, slot, mask=inside)
        tl.store(token_pos + t, pos, mask=inside)
        tl.store(token_valid + t, valid, mask=inside)
        ids = tl.load(tokens + slot * tokens_stride + pos, mask=inside, other=0)
        tl.store(input_ids + t, ids.to(tl.int64), mask=inside)
        if DRAFTS:
            # The slot's last row_count tokens are its sampling rows, in batch order after the earlier slots' rows.
            left = tl.sum(tl.where(at_slot, ends[None, :], 0), 1) - t  # tokens of its slot from t on
            count = tl.sum(tl.where(at_slot, row_count[None, :], 0), 1)
            row = tl.sum(tl.where(at_slot, row_first[None, :], 0), 1) + count - left
            is_row = valid & (left <= count) & (row < R)
            tl.store(sample_token + row, t, mask=is_row)
            tl.store(sample_slot + row, slot, mask=is_row)
            if RUNS:  # each token of a run a decode row, in batch order
                in_run = tl.sum(tl.where(at_slot, runs[None, :].to(tl.int32), 0), 1) != 0
                row = tl.sum(tl.where(at_slot, run_first[None, :] - starts[None, :], 0), 1) + t
                is_row = valid & in_run & (row < R)
                tl.store(decode_start + row, t, mask=is_row)
                tl.store(decode_length + row, 1, mask=is_row)
                tl.store(decode_first + row, pos, mask=is_row)
                tl.store(decode_slot + row, slot, mask=is_row)
        return
    # The rows: decodes, sampling rows, prompt chunks in blocks of QB queries; packed first, slot 0's after them
    # (with drafts the pack's padding is batch token 0's: its slot and position).
    take0, computed0 = tl.load(take_ptr), tl.load(computed_ptr)
    slot0 = tl.minimum(tl.sum((real & (ends <= 0)).to(tl.int64)), S - 1)
    pos0 = tl.where(total > 0, tl.sum(tl.where(s == slot0, computed, 0)), 0)
    if RUNS:
        decodes = tl.sum(run_take)
        r0 = decodes
        while r0 < R:  # a while loop: the interpreter cannot range() over a loaded value
            r = r0 + tl.arange(0, BLOCK_R)
            blank = r < R
            tl.store(decode_start + r, 0, mask=blank)
            tl.store(decode_length + r, 1, mask=blank)
            tl.store(decode_first + r, pos0, mask=blank)
            tl.store(decode_slot + r, slot0, mask=blank)
            r0 += BLOCK_R
        take = tl.where(runs, 0, take)  # the chunks: what is not a run
        take0 = tl.sum(tl.where(s == 0, take, 0))
    else:
        decoding = real & (take == 1)
        rank = tl.cumsum(decoding.to(tl.int64), 0) - 1
        decodes = tl.sum(decoding.to(tl.int64))
        tl.store(decode_start + rank, starts, mask=decoding)
        tl.store(decode_length + rank, take, mask=decoding)
        tl.store(decode_first + rank, computed, mask=decoding)
        tl.store(decode_slot + rank, s, mask=decoding)
        pad = real & (s >= decodes)
        tl.store(decode_start + s, 0, mask=pad)
        tl.store(decode_length + s, take0, mask=pad)
        tl.store(decode_first + s, computed0, mask=pad)
        tl.store(decode_slot + s, 0, mask=pad)

    samples = tl.sum(row_count)
    if DRAFTS:  # the token programs wrote the real rows
        r0 = samples * 0
        while r0 < R:
            q = r0 + tl.arange(0, BLOCK_R)
            unused = (q < R) & (q >= samples)
            tl.store(sample_token + q, 0, mask=unused)
            tl.store(sample_slot + q, slot0, mask=unused)
            tl.store(sample_valid + q, q < samples, mask=q < R)
            r0 += BLOCK_R
    else:
        rank = tl.cumsum(sampling.to(tl.int64), 0) - 1
        tl.store(sample_slot + rank, s, mask=sampling)
        tl.store(sample_token + rank, ends - 1, mask=sampling)
        pad = real & (s >= samples)
        tl.store(sample_slot + s, 0, mask=pad)
        tl.store(sample_token + s, 0, mask=pad)
        tl.store(sample_valid + s, s < samples, mask=real)

    blocks = tl.where(take > 1, (take + QB - 1) // QB, 0)
    first_block = tl.cumsum(blocks, 0) - blocks
    chunks = tl.sum(blocks)
    for j in range(PER_SLOT):
        row = first_block + j
        here = real & (j < blocks) & (row < MAX_CHUNKS)
        tl.store(chunk_start + row, starts + j * QB, mask=here)
        tl.store(chunk_length + row, tl.minimum(take - j * QB, QB), mask=here)
        tl.store(chunk_first + row, computed + j * QB, mask=here)
        tl.store(chunk_slot + row, s, mask=here)
    c = tl.arange(0, BLOCK_C)
    pad = (c < MAX_CHUNKS) & (c >= chunks)
    tl.store(chunk_start + c, 0, mask=pad)
    tl.store(chunk_length + c, tl.minimum(take0, QB), mask=pad)
    tl.store(chunk_first + c, computed0, mask=pad)
    tl.store(chunk_slot + c, 0, mask=pad)

    tl.store(sizes, total)
    tl.store(sizes + 1, tl.max(tl.where(ends > starts, computed + ends - starts, 0)))  # the longest context
    tl.store(sizes + 2, decodes)
    tl.store(sizes + 3, chunks)
    tl.store(sizes + 4, tl.load(moved))
    tl.store(sizes + 5, tl.load(moved + 1))
    if HAS_ENTRIES:
        tl.store(sizes + 6, tl.sum(tl.load(entries + s, mask=real, other=0)))
    else:
        tl.store(sizes + 6, 0)


def lay_out(state: Slots, take: torch.Tensor, entries: torch.Tensor | None, moves, moved: torch.Tensor,
            token_budget: int, draft_rows: int = 0, decode_runs: bool = False) -> StepPlan:
    """scheduler._lay_out's arguments and plan."""
    S, T, device = state.num_slots, token_budget, take.device
    max_chunks = max_chunk_rows(T, S)
    runs = bool(draft_rows) and decode_runs
    R = draft_rows or S  # sampling rows

    def new(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=device)

    token_slot, token_pos, input_ids, token_valid = new(T), new(T), new(T), new(T, torch.bool)
    decode = [new(R if runs else S) for _ in range(4)]
    chunk = [new(max_chunks) for _ in range(4)]
    sample_slot, sample_token, sample_valid, sizes = new(R), new(R), new(R, torch.bool), new(len(PlanSizes._fields))
    block_t = 32
    _lay_out[(triton.cdiv(T, block_t) + 1,)](
        take, state.num_computed, state.seq_len, state.draft_len, state.tokens, state.tokens.stride(0),
        take if entries is None else entries, moved, token_slot, token_pos, token_valid, input_ids, *decode, *chunk,
        sample_slot, sample_token, sample_valid, sizes, S, T, R, HAS_ENTRIES=entries is not None,
        PER_SLOT=T // QUERY_BLOCK + 1, MAX_CHUNKS=max_chunks, DRAFTS=bool(draft_rows), RUNS=runs,
        BLOCK_S=triton.next_power_of_2(S), BLOCK_T=block_t, BLOCK_C=triton.next_power_of_2(max_chunks),
        BLOCK_R=min(1024, triton.next_power_of_2(R)))
    return StepPlan(take, token_slot, token_pos, token_valid, input_ids, QueryRows(*decode, sizes[2]),
                    QueryRows(*chunk, sizes[3]), sample_slot, sample_token, sample_valid, entries, moves, sizes)
