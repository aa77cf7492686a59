"""The plan's last part as one Triton kernel: blink.engine.core.scheduler._lay_out (the torch reference: the batch's
tokens flat, the decode, chunk and sampling rows, the sizes; about seventy small ops, a kernel each in a captured step)
in one launch. Programs 0..n-1 lay out a block of the batch's tokens each, the last one the rows and the sizes; each
takes the prefix sums of the slots' tokens itself. tests/engine/test_lay_out_kernel.py holds it to the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core.scheduler import QUERY_BLOCK, PlanSizes, QueryRows, StepPlan, max_chunk_rows
from blink.engine.core.state import Slots

QB = tl.constexpr(QUERY_BLOCK)


@triton.jit
def _lay_out(take_ptr, computed_ptr, seq_len_ptr, tokens, tokens_stride, entries, moved,
             token_slot, token_pos, token_valid, input_ids,
             decode_start, decode_length, decode_first, decode_slot,
             chunk_start, chunk_length, chunk_first, chunk_slot,
             sample_slot, sample_token, sample_valid, sizes,
             S, T, HAS_ENTRIES: tl.constexpr, PER_SLOT: tl.constexpr, MAX_CHUNKS: tl.constexpr,
             BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    real = s < S
    take = tl.load(take_ptr + s, mask=real, other=0)
    computed = tl.load(computed_ptr + s, mask=real, other=0)
    ends = tl.cumsum(take, 0)
    starts = ends - take
    total = tl.sum(take)
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
        return
    # The rows: decodes, sampling rows, prompt chunks in blocks of QB queries; packed first, slot 0's after them.
    take0, computed0 = tl.load(take_ptr), tl.load(computed_ptr)
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

    sampling = real & (take > 0) & (computed + take == tl.load(seq_len_ptr + s, mask=real, other=0))
    rank = tl.cumsum(sampling.to(tl.int64), 0) - 1
    samples = tl.sum(sampling.to(tl.int64))
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
    tl.store(sizes + 1, tl.max(tl.where(take > 0, computed + take, 0)))  # the longest context
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
    if draft_rows:
        raise NotImplementedError("the layout kernel lays out one sampling row per slot: no drafts")
    S, T, device = state.num_slots, token_budget, take.device
    max_chunks = max_chunk_rows(T, S)

    def new(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=device)

    token_slot, token_pos, input_ids, token_valid = new(T), new(T), new(T), new(T, torch.bool)
    decode = [new(S) for _ in range(4)]
    chunk = [new(max_chunks) for _ in range(4)]
    sample_slot, sample_token, sample_valid, sizes = new(S), new(S), new(S, torch.bool), new(len(PlanSizes._fields))
    block_t = 32
    _lay_out[(triton.cdiv(T, block_t) + 1,)](
        take, state.num_computed, state.seq_len, state.tokens, state.tokens.stride(0),
        take if entries is None else entries, moved, token_slot, token_pos, token_valid, input_ids, *decode, *chunk,
        sample_slot, sample_token, sample_valid, sizes, S, T, HAS_ENTRIES=entries is not None,
        PER_SLOT=T // QUERY_BLOCK + 1, MAX_CHUNKS=max_chunks, BLOCK_S=triton.next_power_of_2(S), BLOCK_T=block_t,
        BLOCK_C=triton.next_power_of_2(max_chunks))
    return StepPlan(take, token_slot, token_pos, token_valid, input_ids, QueryRows(*decode, sizes[2]),
                    QueryRows(*chunk, sizes[3]), sample_slot, sample_token, sample_valid, entries, moves, sizes)
