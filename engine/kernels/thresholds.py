"""Thresholds on a row of logits, found without a sort: the searches the sampler's filters and logprobs run.

A threshold is a key: float32 → int32 in the floats' order (`to_key`), so a filter that keeps values (top-k, top-p,
the top logprobs) keeps the keys from some t up. `search` finds t by weighing a row against PIVOTS keys a pass, about
eight passes from 2**32 keys to one. Over a whole row that is eight reads of it in one program; so a row is first
cut into chunks, many programs a row, each handing in at most M of its highest keys (`hand_in`: the first bins of a
histogram of their distance below the chunk's maximum, since Triton's sort runs at seconds a chunk in its
interpreter), its maximum, its sum of exp and the highest key it left out. Every key above the highest of those is
a candidate, so a threshold with its limit's weight above that lies among the candidates and is searched there; a
row that cannot be settled so (a flat one) is searched whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # logits a program reads at a time
PIVOTS = 16  # keys a threshold-search pass tests at once
CHUNK = 4096  # logits one program of a row's chunked passes reads: a 128K vocabulary over 32 programs
CANDIDATES = 64  # keys each chunk of a row hands in at most: 2,048 for a 128K vocabulary in chunks of 4,096
BINS = 512  # the histogram a chunk picks its candidates by: distances below its maximum, in steps of BIN_WIDTH
BIN_WIDTH = tl.constexpr(1 / 32)  # logits over T: 16 below the maximum in all, past a real model's top 64 of a chunk
NONE = tl.constexpr(-(1 << 31))  # below every value's key: an empty candidate cell (its value is a NaN)
LOWEST = tl.constexpr(-(1 << 63))  # below every packed (key, id): an empty cell of a row's top, a chunk's best
STATS = tl.constexpr(3)  # words a chunk hands in beside its keys: its maximum, its sum of exp, the key it left out


@triton.jit
def to_key(x):
    """float32 → int32 in the floats' order (both zeros the same key)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def from_key(key):
    """to_key's inverse: the float32 whose key it is."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def scaled(row, start, V, T, BLOCK: tl.constexpr):
    """A block of the row divided by its temperature (-inf past the vocabulary), its ids, and which are real."""
    ids = start + tl.arange(0, BLOCK)
    real = ids < V
    x = tl.load(row + ids, mask=real, other=float("-inf"))
    return tl.div_rn(x, T), ids, real  # IEEE's division, as the reference's: a GPU's `/` is off by up to 2 ulp


@triton.jit
def kept(s, top, log_min_p, key_floor):
    """The filters' verdict on a block: min-p, then a threshold search's key floor."""
    return (s - top >= log_min_p) & (to_key(s) >= key_floor)


@triton.jit
def weight(s, real, top, log_min_p, key_floor, MASS: tl.constexpr):
    """What each of a block's values weighs where the filters keep it (MASS: its exp below `top`, else 1), else 0."""
    keep = kept(s, top, log_min_p, key_floor) & real
    return tl.where(keep, tl.exp(s - top), 0.0) if MASS else keep.to(tl.float32)


@triton.jit
def block_of(src, start, V, T, KEYS: tl.constexpr, BLOCK: tl.constexpr):
    """A block of what a search reads, and which of it is real: a row's logits over T, or (KEYS) a plan's
    candidate keys as the values they are (an empty cell's key is NaN's, which no filter keeps)."""
    if KEYS:
        ids = start + tl.arange(0, BLOCK)
        real = ids < V
        s = from_key(tl.load(src + ids, mask=real, other=NONE, cache_modifier=".cg"))  # other programs' stores
    else:
        s, _, real = scaled(src, start, V, T, BLOCK)
    return s, real


@triton.jit
def search(src, V, T, top, log_min_p, k_floor, limit, lo, MASS: tl.constexpr, KEYS: tl.constexpr,
            BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """The smallest key t above `lo` at which fewer than `limit` kept tokens (MASS: less than `limit` of the kept
    mass; of the row's, as a share of it, unless KEYS) lie above t: keys from t up are what the filter keeps. `lo`
    must have at least `limit` above it: -2**31 - 1, below every key, does. Returns t and the passes it took."""
    lo = lo.to(tl.int64)
    hi = to_key(top).to(tl.int64)  # nothing lies above the maximum
    passes = tl.full([], 0, tl.int32)
    while hi - lo > 1:
        pivots = lo + 1 + ((hi - lo - 2) * tl.arange(0, PIVOTS)) // PIVOTS  # all strictly between lo and hi
        above = tl.zeros([PIVOTS], dtype=tl.float32)
        total = tl.full([], 0.0, tl.float32)
        start = tl.full([], 0, tl.int32)
        while start < V:  # not range(): Triton 3.6's interpreter cannot range over an argument
            s, real = block_of(src, start, V, T, KEYS, BLOCK)
            w = weight(s, real, top, log_min_p, k_floor, MASS)
            higher = to_key(s).to(tl.int64)[:, None] > pivots[None, :]
            above += tl.sum(tl.where(higher, w[:, None], 0.0), 0)
            total += tl.sum(w, 0)
            start += BLOCK
        bound = limit if KEYS else (limit * total if MASS else limit)
        below = above < bound  # less than the limit above a pivot: its key is kept
        hi = tl.min(tl.where(below, pivots, hi), 0)
        lo = tl.max(tl.where(below, lo, pivots), 0)
        passes += 1
    return hi.to(tl.int32), passes


@triton.jit
def weigh(cand, N, top, lmp, k_floor, low, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The kept weight (MASS: mass, else count) of a plan's N candidate keys: above `low`, and in all."""
    over = tl.full([], 0.0, tl.float32)
    total = tl.full([], 0.0, tl.float32)
    start = tl.full([], 0, tl.int32)
    while start < N:
        v, real = block_of(cand, start, N, 1.0, True, BLOCK)
        w = weight(v, real, top, lmp, k_floor, MASS)
        over += tl.sum(tl.where(to_key(v) > low, w, 0.0), 0)
        total += tl.sum(w, 0)
        start += BLOCK
    return over, total


@triton.jit
def row_scratch(cand, ids, stats, r, chunks, M: tl.constexpr):
    """Row r's part of what its chunks hand in (candidates()'s tensors)."""
    first = r * chunks
    return cand + first * M, ids + first * M, stats + first * STATS


@triton.jit
def hand_in(row, V, c, T, cand, ids, stats, CHUNK: tl.constexpr, M: tl.constexpr, BINS: tl.constexpr,
            IDS: tl.constexpr):
    """Chunk c's part of a row's candidates (its logits over T), into the row's scratch (row_scratch's): at most M
    of its highest keys (and, IDS, their ids), in the order of their ids, the rest of its M cells empty; and its
    maximum, its sum of exp below it, and the highest key it left out. The keys handed in are those of the first
    bins of a histogram of their distance below the maximum (BIN_WIDTH wide) that hold M or fewer."""
    cand += c * M
    ids += c * M
    stats += c * STATS
    s, at, _ = scaled(row, c * CHUNK, V, T, CHUNK)
    key = to_key(s)
    m = tl.max(s, 0)
    below = tl.where(s > float("-inf"), tl.minimum((m - s) * (1.0 / BIN_WIDTH), BINS - 1), BINS - 1).to(tl.int32)
    held = tl.cumsum(tl.histogram(below, BINS), 0)
    bins = tl.arange(0, BINS)
    taken = tl.sum(((held <= M) & (bins < BINS - 1)).to(tl.int32), 0)  # the last bin holds the rest, never taken
    chosen = below < taken
    cell = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(cand + cell, key, mask=chosen)
    if IDS:
        tl.store(ids + cell, at, mask=chosen)
    cells = tl.arange(0, M)
    tl.store(cand + cells, tl.full([M], NONE, tl.int32), mask=cells >= tl.sum(chosen.to(tl.int32), 0))
    tl.store(stats + 0, m)
    tl.store(stats + 1, tl.where(m > float("-inf"), tl.sum(tl.exp(s - m), 0), 0.0))
    tl.store(stats + 2, tl.max(tl.where(chosen, NONE, key), 0).to(tl.float32, bitcast=True))


@triton.jit
def chunk_stats(stats, chunks, CHUNKS: tl.constexpr):
    """What a row's chunks handed in besides their candidates: each one's maximum and sum of exp below it ([CHUNKS]),
    the row's maximum, and `low`, the highest key a chunk left out: every key above it is a candidate."""
    c = tl.arange(0, CHUNKS)
    inside = c < chunks
    at = stats + STATS * c
    m = tl.load(at, mask=inside, other=float("-inf"), cache_modifier=".cg")  # other programs' stores
    z = tl.load(at + 1, mask=inside, other=0.0, cache_modifier=".cg")
    lows = tl.load(at + 2, mask=inside, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
    return m, z, tl.max(m, 0), tl.max(tl.where(inside, lows, NONE), 0)


@triton.jit
def mass(m, z, top):
    """A row's sum of exp below its maximum `top`, from its chunks' maxima and sums (chunk_stats')."""
    return tl.sum(tl.where(m > float("-inf"), z * tl.exp(m - top), 0.0), 0)


def candidate_sizes(V: int, chunk: int) -> dict[str, int]:
    """hand_in's sizes for a vocabulary of V in chunks of `chunk`."""
    return dict(CHUNK=chunk, CHUNKS=triton.next_power_of_2(triton.cdiv(V, chunk)), M=min(CANDIDATES, chunk),
                BINS=BINS)


def candidates(rows: int, V: int, chunk: int, device: torch.device, ids: bool) -> tuple[torch.Tensor, ...]:
    """Room for what rows' chunks hand in: their keys, their ids (ids: else the keys stand in, unwritten), their
    STATS words."""
    chunks, m = triton.cdiv(V, chunk), min(CANDIDATES, chunk)
    keys = torch.empty(rows, chunks, m, dtype=torch.int32, device=device)
    return (keys, torch.empty_like(keys) if ids else keys,
            torch.empty(rows, chunks, STATS.value, dtype=torch.float32, device=device))
