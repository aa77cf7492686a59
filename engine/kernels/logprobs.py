"""Logprobs as Triton kernels: a row's log-sum-exp, its token's logprob and the candidates for its top TOP, the top
found as a threshold (blink.engine.kernels.thresholds), never by sorting the row.

A row that asked is scored over many programs (`score_part`, CHUNK logits each): each chunk hands in its highest keys
with their ids, its maximum and its sum of exp; the last of the row's programs to finish (a ticket) takes the
log-sum-exp from the sums, searches the top's threshold among the candidates and writes those above it, then the
lowest ids of those at it, to the row's cells, which the caller sorts. Where the candidates cannot settle the top
(fewer than TOP of them above the highest key a chunk left out: a flat row), that program finds the top over the
whole row (`_row_top`: a search, then a pass writing it); the log-sum-exp is the sums' either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.kernels.thresholds import (
    BLOCK,
    CHUNK,
    LOWEST,
    NONE,
    PIVOTS,
    candidate_sizes,
    candidates,
    chunk_stats,
    hand_in,
    mass,
    row_scratch,
    scaled,
    search,
    to_key,
    weigh,
)
from blink.engine.kernels.tickets import last_to_finish, tickets
from blink.shared.request_schema import MAX_LOGPROBS


@triton.jit
def _write_top(key, ids, real, floor, top_keys, above, tied, V, TOP: tl.constexpr):
    """A block's part of a row's top: its keys above `floor` packed with their ids (the lower id first among equal
    logits) into the first TOP cells, those at it into the next TOP while room lasts. Returns the counts so far."""
    packed = (key.to(tl.int64) << 32) | (V - 1 - ids).to(tl.int64)
    higher = real & (key > floor)
    at = above + tl.cumsum(higher.to(tl.int32), 0) - 1
    tl.store(top_keys + at, packed, mask=higher)
    equal = real & (key == floor)
    at = tied + tl.cumsum(equal.to(tl.int32), 0) - 1
    tl.store(top_keys + TOP + at, packed, mask=equal & (at < TOP))
    return above + tl.sum(higher.to(tl.int32), 0), tied + tl.sum(equal.to(tl.int32), 0)


@triton.jit
def _row_top(row, V, top, top_keys, TOP: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """A row's top found over the whole row in one program (its maximum `top`): the keys above its threshold, fewer
    than TOP, then the lowest ids of those at it, in `top_keys`. Returns the passes it took."""
    floor, searched = search(row, V, 1.0, top, float("-inf"), tl.full([], NONE, tl.int32), TOP,
                             tl.full([], NONE - 1, tl.int64), False, False, BLOCK, PIVOTS)
    above = tl.full([], 0, tl.int32)
    tied = tl.full([], 0, tl.int32)
    start = tl.full([], 0, tl.int32)
    while start < V:
        x, ids, real = scaled(row, start, V, 1.0, BLOCK)
        above, tied = _write_top(to_key(x), ids, real, floor, top_keys, above, tied, V, TOP)
        start += BLOCK
    return 1 + searched


@triton.jit
def score_part(row, V, c, chunks, token, cand, ids, stats, ticket, top_keys, TOP: tl.constexpr,
               CELLS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, M: tl.constexpr, BINS: tl.constexpr,
               BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """Chunk c's part of scoring a row: it hands in its candidates (into the row's scratch, row_scratch's); the last
    of the row's programs to finish (its ticket) empties the row's CELLS cells and scores it. Returns whether this
    program was that one and, if so, the row's logprob, log-sum-exp and passes over it."""
    hand_in(row, V, c, 1.0, cand, ids, stats, CHUNK, M, BINS, True)
    last = last_to_finish(ticket, chunks)
    logprob = tl.full([], 0.0, tl.float32)
    lse = tl.full([], 0.0, tl.float32)
    passes = tl.full([], 0, tl.int32)
    if last:
        tl.store(top_keys + tl.arange(0, CELLS), tl.full([CELLS], LOWEST, tl.int64))
        tl.debug_barrier()
        m, z, top, low = chunk_stats(stats, chunks, CHUNKS)
        lse = top + tl.log(mass(m, z, top))
        logprob = tl.load(row + token) - lse
        N = chunks * M
        over, _total = weigh(cand, N, top, float("-inf"), tl.full([], NONE, tl.int32), low, False, BLOCK)
        if over >= TOP:  # the top lies above every key left out: among the candidates
            floor, _searched = search(cand, N, 1.0, top, float("-inf"), tl.full([], NONE, tl.int32), TOP, low, False,
                                      True, BLOCK, PIVOTS)
            above = tl.full([], 0, tl.int32)
            tied = tl.full([], 0, tl.int32)
            start = tl.full([], 0, tl.int32)
            while start < N:
                i = start + tl.arange(0, BLOCK)
                inside = i < N
                key = tl.load(cand + i, mask=inside, other=NONE, cache_modifier=".cg")  # other programs' stores
                at = tl.load(ids + i, mask=inside, other=0, cache_modifier=".cg")
                above, tied = _write_top(key, at, inside, floor, top_keys, above, tied, V, TOP)
                start += BLOCK
            passes = tl.full([], 1, tl.int32)
        else:
            passes = 1 + _row_top(row, V, top, top_keys, TOP, BLOCK, PIVOTS)
    return last, logprob, lse, passes


@triton.jit
def _logprobs_kernel(logits, stride, V, asked, tokens, logprob, lse_out, top_keys, passes, cand, ids, stats, tickets,
                     TOP: tl.constexpr, CELLS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                     M: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """Grid: rows x chunks of the vocabulary; the rows that asked (asked >= 0) scored (score_part)."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    if tl.load(asked + r) >= 0:
        keys, at, sums = row_scratch(cand, ids, stats, r, chunks, M)
        last, lp, lse, n = score_part(logits + r.to(tl.int64) * stride, V, c, chunks, tl.load(tokens + r), keys, at,
                                      sums, tickets + r, top_keys + r * CELLS, TOP, CELLS, CHUNK, CHUNKS, M, BINS,
                                      BLOCK, PIVOTS)
        if last:
            tl.store(lse_out + r, lse)
            tl.store(logprob + r, lp)
            tl.store(passes + r, n)


def score_sizes(V: int, chunk: int) -> dict[str, int]:
    """score_part's sizes for a vocabulary of V in chunks of `chunk`."""
    top = min(MAX_LOGPROBS, V)
    return dict(TOP=top, CELLS=triton.next_power_of_2(2 * top), **candidate_sizes(V, chunk))


def logprobs(logits: torch.Tensor, asked: torch.Tensor, tokens: torch.Tensor, block: int = BLOCK,
             chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token's logprob and the top MAX_LOGPROBS of the rows that asked (asked >= 0; the others get 0 and ids
    -1), and the passes over its logits each row took."""
    R, V = logits.shape
    logprob = torch.zeros(R, dtype=torch.float32, device=logits.device)
    passes = torch.zeros(R, dtype=torch.int32, device=logits.device)
    lse = torch.zeros(R, dtype=torch.float32, device=logits.device)
    sizes = score_sizes(V, chunk)
    top = sizes["TOP"]
    keys = torch.full((R, sizes["CELLS"]), LOWEST.value, dtype=torch.int64, device=logits.device)
    if R:
        _logprobs_kernel[(R, triton.cdiv(V, chunk))](
            logits, logits.stride(0), V, asked, tokens, logprob, lse, keys, passes,
            *candidates(R, V, chunk, logits.device, ids=True), tickets("logprobs", logits.device, R), BLOCK=block,
            PIVOTS=PIVOTS, **sizes, num_warps=max(1, min(8, chunk // 512)))
    keys = keys.topk(top, dim=-1).values
    ordered = (keys >> 32).to(torch.int32)
    values = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(torch.float32)
    wanted = (asked >= 0)[:, None]
    return (logprob, torch.where(wanted, V - 1 - (keys & 0xFFFFFFFF), -1),
            torch.where(wanted, values - lse[:, None], 0.0), passes)
