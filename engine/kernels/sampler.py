"""The sampler as Triton kernels: each row's logits read as often as its own request needs, and no sort.

`fused_sample` is `blink.engine.core.sampler.sample` (the reference, which the CPU runs) for the device: the same
tokens for the same inputs. Each row pays for what its own request asked: a greedy row is one argmax pass; a row
that samples is one pass of noise and argmax; min-p, top-k and top-p add one pass that plans them; logprobs a pass
for the log-sum-exp, a search and a pass to write the top. So a captured step that must serve every feature costs a
batch of greedy requests one pass, not the sort and the [rows, vocab] temporaries of the reference.

Both passes run over many programs a row (CHUNK logits each), so a batch of one fills the GPU rather than one of
its SMs. The draw (`_draw_chunk`) packs each chunk's best with its id, so the largest is torch's argmax; the chunks'
best are combined after (`_draw` here; the step sampler's finishing program there). The filters keep values, not
positions (as the reference does), so each is a threshold on the 32-bit keys whose integer order is the floats':
top-k keeps what has fewer than k kept tokens above it, top-p what has less than top_p of the kept mass above it.
The plan (`_plan_kernel`) has each chunk hand in its CANDIDATES highest keys, its maximum and its sum of exp; the last
chunk's program to finish sorts the candidates and reads both thresholds off their running sums, as the reference
reads them off its sorted row. The candidates hold every key above the highest of the chunks' lowest, which settles a
threshold whenever what lies above that already reaches it: a real model's nucleus does, a flat row's may not, and
then that program searches the row whole (`_search`: each pass weighs the row against PIVOTS keys at once, about
eight passes). The sparse edits (logit biases, penalties, held tokens) are the reference's own, done in place on the
ids they name and undone after the draw, so the logits stay raw for the logprobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core.sampler import (
    GREEDY_BELOW,
    SampleOutput,
    SamplerFeatures,
    SamplingRows,
    edit_logits,
    edits,
)
from blink.engine.kernels.tickets import tickets
from blink.shared.request_schema import MAX_LOGPROBS

BLOCK = 1024  # logits a program reads at a time
PIVOTS = 16  # keys a threshold-search pass tests at once
CHUNK = 4096  # logits one program of a row's draw reads: a 128K vocabulary over 32 programs
DRAW = 8  # int32 words a row's planned draw takes in `draw` (_plan_words)
CANDIDATES = 64  # keys each chunk of a filtered row hands its plan at most: 2,048 for a 128K vocabulary
BINS = 512  # the histogram a chunk picks its candidates by: distances below its maximum, in steps of BIN_WIDTH
BIN_WIDTH = tl.constexpr(1 / 32)  # logits over T: 16 below the maximum in all, past a real model's top 64 of a chunk
_LOWEST = tl.constexpr(-(1 << 63))  # below every packed key
_NONE = tl.constexpr(-(1 << 31))  # below every value's key: an empty candidate cell (its value is a NaN)
_MUL2 = tl.constexpr(0x846CA68B - (1 << 32))  # lowbias32's second multiplier as an int32 (products wrap as it wants)
_GOLDEN = tl.constexpr(0x9E3779B9 - (1 << 32))  # what noise_key mixes into the seed's high word, as an int32


@triton.jit
def _key(x):
    """float32 → int32 in the floats' order (both zeros the same key)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _shr(x, k: tl.constexpr):
    return (x >> k) & ((1 << (32 - k)) - 1)  # a logical shift of int32 words


@triton.jit
def _hash(x):
    """lowbias32 on int32 words (blink.engine.core.sampler.hash32_words)."""
    x = x ^ _shr(x, 16)
    x = x * 0x7FEB352D
    x = x ^ _shr(x, 15)
    x = x * _MUL2
    return x ^ _shr(x, 16)


@triton.jit
def _noise_key(seed, step_index):
    """blink.engine.core.sampler.noise_key for one row: its seed's two words and its token's index, hashed."""
    key = _hash(seed.to(tl.int32)) ^ _hash((seed >> 32).to(tl.int32) ^ _GOLDEN)
    return _hash(_hash(key) ^ step_index.to(tl.int32))


@triton.jit
def _scaled(row, start, V, T, BLOCK: tl.constexpr):
    """A block of the row divided by its temperature (-inf past the vocabulary), its ids, and which are real."""
    ids = start + tl.arange(0, BLOCK)
    real = ids < V
    x = tl.load(row + ids, mask=real, other=float("-inf"))
    return x / T, ids, real


@triton.jit
def _kept(s, top, log_min_p, key_floor):
    """The filters' verdict on a block: min-p, then a threshold search's key floor."""
    return (s - top >= log_min_p) & (_key(s) >= key_floor)


@triton.jit
def _block(src, start, V, T, KEYS: tl.constexpr, BLOCK: tl.constexpr):
    """A block of what a search reads, and which of it is real: a row's logits over T, or (KEYS) a plan's
    candidate keys as the values they are (an empty cell's key is NaN's, which no filter keeps)."""
    ids = start + tl.arange(0, BLOCK)
    real = ids < V
    if KEYS:
        s = _value(tl.load(src + ids, mask=real, other=_NONE, cache_modifier=".cg"))  # other programs' stores
    else:
        s = tl.load(src + ids, mask=real, other=float("-inf")) / T
    return s, real


@triton.jit
def _search(src, V, T, top, log_min_p, k_floor, limit, lo, MASS: tl.constexpr, KEYS: tl.constexpr,
            BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """The smallest key t above `lo` at which fewer than `limit` kept tokens (MASS: less than `limit` of the kept
    mass; of the row's, as a share of it, unless KEYS) lie above t: keys from t up are what the filter keeps. `lo`
    must have at least `limit` above it: -2**31 - 1, below every key, does. Returns t and the passes it took."""
    lo = lo.to(tl.int64)
    hi = _key(top).to(tl.int64)  # nothing lies above the maximum
    passes = tl.full([], 0, tl.int32)
    while hi - lo > 1:
        pivots = lo + 1 + ((hi - lo - 2) * tl.arange(0, PIVOTS)) // PIVOTS  # all strictly between lo and hi
        above = tl.zeros([PIVOTS], dtype=tl.float32)
        total = tl.full([], 0.0, tl.float32)
        start = tl.full([], 0, tl.int32)
        while start < V:  # not range(): Triton 3.6's interpreter cannot range over an argument
            s, real = _block(src, start, V, T, KEYS, BLOCK)
            kept = _kept(s, top, log_min_p, k_floor) & real
            weight = tl.where(kept, tl.exp(s - top), 0.0) if MASS else kept.to(tl.float32)
            higher = _key(s).to(tl.int64)[:, None] > pivots[None, :]
            above += tl.sum(tl.where(higher, weight[:, None], 0.0), 0)
            total += tl.sum(weight, 0)
            start += BLOCK
        bound = limit if KEYS else (limit * total if MASS else limit)
        below = above < bound  # less than the limit above a pivot: its key is kept
        hi = tl.min(tl.where(below, pivots, hi), 0)
        lo = tl.max(tl.where(below, lo, pivots), 0)
        passes += 1
    return hi.to(tl.int32), passes


@triton.jit
def _weigh(cand, N, top, lmp, k_floor, low, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The kept weight (MASS: mass, else count) of a plan's N candidate keys: above `low`, and in all."""
    over = tl.full([], 0.0, tl.float32)
    total = tl.full([], 0.0, tl.float32)
    start = tl.full([], 0, tl.int32)
    while start < N:
        v, real = _block(cand, start, N, 1.0, True, BLOCK)
        kept = _kept(v, top, lmp, k_floor) & real
        w = tl.where(kept, tl.exp(v - top), 0.0) if MASS else kept.to(tl.float32)
        over += tl.sum(tl.where(_key(v) > low, w, 0.0), 0)
        total += tl.sum(w, 0)
        start += BLOCK
    return over, total


@triton.jit
def _value(key):
    """_key's inverse: the float32 whose key it is."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _plan_words(T, lmp, k, p, key, draw):
    """A row's draw words (DRAW of them at `draw`): T (its temperature, 0 below GREEDY_BELOW: greedy), lmp (log
    min_p), the row's maximum and the top-k and top-p key floors (what keeps everything, until _plan_filters finds
    them), its noise key, k and p."""
    tl.store(draw + 0, T.to(tl.int32, bitcast=True))
    tl.store(draw + 1, lmp.to(tl.int32, bitcast=True))
    tl.store(draw + 2, tl.full([], float("inf"), tl.float32).to(tl.int32, bitcast=True))
    tl.store(draw + 3, -(1 << 31))
    tl.store(draw + 4, -(1 << 31))
    tl.store(draw + 5, key.to(tl.int32))
    tl.store(draw + 6, k.to(tl.int32))
    tl.store(draw + 7, p.to(tl.int32, bitcast=True))


@triton.jit
def _filters(at):
    """A row's planned T, lmp, k and p, and whether it samples through a filter."""
    T = tl.load(at + 0).to(tl.float32, bitcast=True)
    lmp = tl.load(at + 1).to(tl.float32, bitcast=True)
    k = tl.load(at + 6)
    p = tl.load(at + 7).to(tl.float32, bitcast=True)
    return T, lmp, k, p, (T > 0.0) & ((lmp > float("-inf")) | (k > 0) | (p < 1.0))


@triton.jit
def _plan_chunk(row, V, c, T, cand, stats, CHUNK: tl.constexpr, M: tl.constexpr, BINS: tl.constexpr):
    """Chunk c's part of a filtered row's plan (scaled by T): at most M of its highest keys to `cand` (the rest of
    its M cells empty), and to `stats` its maximum, its sum of exp below it, and the highest key it left out. The
    keys handed in are those of the first bins of a histogram of their distance below the maximum (BIN_WIDTH wide)
    that hold M or fewer."""
    s, _, _ = _scaled(row, c * CHUNK, V, T, CHUNK)
    key = _key(s)
    m = tl.max(s, 0)
    below = tl.where(s > float("-inf"), tl.minimum((m - s) * (1.0 / BIN_WIDTH), BINS - 1), BINS - 1).to(tl.int32)
    held = tl.cumsum(tl.histogram(below, BINS), 0)
    bins = tl.arange(0, BINS)
    taken = tl.sum(((held <= M) & (bins < BINS - 1)).to(tl.int32), 0)  # the last bin holds the rest, never taken
    chosen = below < taken
    tl.store(cand + tl.cumsum(chosen.to(tl.int32), 0) - 1, key, mask=chosen)
    cells = tl.arange(0, M)
    tl.store(cand + cells, tl.full([M], _NONE, tl.int32), mask=cells >= tl.sum(chosen.to(tl.int32), 0))
    tl.store(stats + 0, m)
    tl.store(stats + 1, tl.where(m > float("-inf"), tl.sum(tl.exp(s - m), 0), 0.0))
    tl.store(stats + 2, tl.max(tl.where(chosen, _NONE, key), 0).to(tl.float32, bitcast=True))


@triton.jit
def _plan_filters(row, V, at, cand, stats, chunks, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
                  CHUNKS: tl.constexpr, M: tl.constexpr):
    """A filtered row's maximum and top-k and top-p key floors, written to its draw words, from its chunks'
    candidates and sums. Every key above `low` (the highest a chunk left out) is a candidate, so a threshold with its
    limit's weight above `low` lies above it and is searched among the candidates; a limit that all the kept weight
    falls short of keeps everything, where the candidates hold all of it (whole). Otherwise the row is searched
    whole. Returns the passes over the row that took beyond the chunks' own."""
    T, lmp, k, p, _ = _filters(at)
    c = tl.arange(0, CHUNKS)
    inside = c < chunks
    m = tl.load(stats + 3 * c, mask=inside, other=float("-inf"), cache_modifier=".cg")
    z = tl.load(stats + 3 * c + 1, mask=inside, other=0.0, cache_modifier=".cg")
    lows = tl.load(stats + 3 * c + 2, mask=inside, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
    low = tl.max(tl.where(inside, lows, _NONE), 0)
    top = tl.max(m, 0)
    N = chunks * M
    nothing = tl.full([], -(1 << 31), tl.int32)  # the floor that keeps everything
    whole = ~(_value(low) - top >= lmp)  # min-p drops `low`, so every kept token is a candidate
    passes = tl.full([], 0, tl.int32)
    k_floor = nothing
    if (k > 0) & (k < V):  # a k past the vocabulary keeps everything
        over, _counted = _weigh(cand, N, top, lmp, nothing, low, False, BLOCK)
        if over >= k:
            k_floor, _among = _search(cand, N, 1.0, top, lmp, nothing, k.to(tl.float32), low, False, True, BLOCK,
                                      PIVOTS)
        elif ~whole:
            k_floor, passes = _search(row, V, T, top, lmp, nothing, k.to(tl.float32), nothing.to(tl.int64) - 1, False,
                                      False, BLOCK, PIVOTS)
    p_floor = nothing
    if p < 1.0:
        whole = whole | (k_floor > low)
        over, total = _weigh(cand, N, top, lmp, k_floor, low, True, BLOCK)
        if ~whole:  # nothing filtered before top-p, or the row is searched: the chunks' sums are the row's
            total = tl.sum(tl.where(m > float("-inf"), z * tl.exp(m - top), 0.0), 0)
        if (whole | ((lmp == float("-inf")) & (k_floor == nothing))) & (over >= p * total):
            p_floor, _among = _search(cand, N, 1.0, top, lmp, k_floor, p * total, low, True, True, BLOCK, PIVOTS)
        elif ~whole:
            p_floor, searched = _search(row, V, T, top, lmp, k_floor, p, nothing.to(tl.int64) - 1, True, False, BLOCK,
                                        PIVOTS)
            passes += searched
    tl.store(at + 2, top.to(tl.int32, bitcast=True))
    tl.store(at + 3, k_floor)
    tl.store(at + 4, p_floor)
    return passes


@triton.jit
def _plan_kernel(logits, stride, V, draw, cand, stats, tickets, passes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                 M: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, DRAW: tl.constexpr):
    """Grid: rows x chunks of the vocabulary. A filtered row's programs each hand in their chunk's candidates
    (_plan_chunk); the last of them to finish (a ticket) plans the row's filters (_plan_filters). Other rows' programs
    do nothing: their words already keep everything."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    at = draw + r * DRAW
    T, _, _, _, filtered = _filters(at)
    if filtered:
        row = logits + r.to(tl.int64) * stride
        mine = r * chunks + c
        _plan_chunk(row, V, c, T, cand + mine * M, stats + mine * 3, CHUNK, M, BINS)
        tl.debug_barrier()  # every thread's store issued before the ticket releases it
        if tl.atomic_add(tickets + r, 1, sem="acq_rel", scope="gpu") == chunks - 1:
            tl.atomic_xchg(tickets + r, 0, sem="relaxed", scope="gpu")
            searched = _plan_filters(row, V, at, cand + r * chunks * M, stats + r * chunks * 3, chunks, BLOCK, PIVOTS,
                                     CHUNKS, M)
            tl.store(passes + r, tl.load(passes + r) + 1 + searched)


@triton.jit
def _draw_chunk(row, V, c, at, CHUNK: tl.constexpr):
    """The best of chunk c of a row's logits by its planned draw (`at`: _plan_words' words), as a packed key: the
    value's key, then the id reversed, so the largest is the highest value and, among equal ones, the lowest id
    (torch's argmax)."""
    T = tl.load(at + 0).to(tl.float32, bitcast=True)
    random = T > 0.0
    s, ids, real = _scaled(row, c * CHUNK, V, tl.where(random, T, 1.0), CHUNK)
    if random:  # Gumbel-max over what the filters kept, with the reference's noise
        lmp = tl.load(at + 1).to(tl.float32, bitcast=True)
        top = tl.load(at + 2).to(tl.float32, bitcast=True)
        bits = _hash(tl.load(at + 5) ^ _hash(ids))
        u = (_shr(bits, 9).to(tl.float32) + 0.5) * (1.0 / (1 << 23))
        kept = _kept(s, top, lmp, tl.load(at + 3)) & (_key(s) >= tl.load(at + 4)) & (s > float("-inf"))
        s = tl.where(kept, s - tl.log(-tl.log(u)), float("-inf"))
    packed = tl.where(real, (_key(s).to(tl.int64) << 32) | (V - 1 - ids).to(tl.int64), _LOWEST)
    return tl.max(packed, 0)


@triton.jit
def _draw_kernel(logits, stride, V, draw, best, CHUNK: tl.constexpr, DRAW: tl.constexpr):
    """A row's draw over many programs (grid: rows x chunks of the vocabulary), each chunk's best in `best`."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    tl.store(best + r * tl.num_programs(1) + c, _draw_chunk(logits + r.to(tl.int64) * stride, V, c, draw + r * DRAW,
                                                            CHUNK))


@triton.jit
def _params_kernel(temperature, log_min_p, top_k, top_p, seed, step_index, draw, passes,
                   GREEDY_BELOW: tl.constexpr, DRAW: tl.constexpr):
    """A row's draw words from its parameters, and the draw's own pass."""
    r = tl.program_id(0)
    T = tl.load(temperature + r)
    _plan_words(tl.where(T >= GREEDY_BELOW, T, 0.0), tl.load(log_min_p + r), tl.load(top_k + r), tl.load(top_p + r),
                _noise_key(tl.load(seed + r), tl.load(step_index + r)), draw + r * DRAW)
    tl.store(passes + r, 1)


@triton.jit
def _score_row(row, V, token, top_keys, TOP: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """One row's log-sum-exp and its token's logprob; the candidates for its top TOP written to `top_keys` (2 * TOP
    cells): the keys above a threshold (fewer than TOP), then the lowest ids of those at it (ties), packed with
    their ids. Returns (logprob, lse, passes)."""
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    start = tl.full([], 0, tl.int32)
    while start < V:  # the log-sum-exp, online
        x, _, _ = _scaled(row, start, V, 1.0, BLOCK)
        new_m = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
        m = new_m
        start += BLOCK
    lse = m + tl.log(total)
    floor, searched = _search(row, V, 1.0, m, float("-inf"), tl.full([], -(1 << 31), tl.int32), TOP,
                              tl.full([], -(1 << 31) - 1, tl.int64), False, False, BLOCK, PIVOTS)
    above = tl.full([], 0, tl.int32)
    tied = tl.full([], 0, tl.int32)
    start = tl.full([], 0, tl.int32)
    while start < V:
        x, ids, real = _scaled(row, start, V, 1.0, BLOCK)
        key = _key(x)
        packed = (key.to(tl.int64) << 32) | (V - 1 - ids).to(tl.int64)  # equal logits: the lower id first
        higher = real & (key > floor)
        at = above + tl.cumsum(higher.to(tl.int32), 0) - 1
        tl.store(top_keys + at, packed, mask=higher)
        equal = real & (key == floor)
        at = tied + tl.cumsum(equal.to(tl.int32), 0) - 1
        tl.store(top_keys + TOP + at, packed, mask=equal & (at < TOP))
        above += tl.sum(higher.to(tl.int32), 0)
        tied += tl.sum(equal.to(tl.int32), 0)
        start += BLOCK
    return tl.load(row + token) - lse, lse, 2 + searched


@triton.jit
def _logprobs_kernel(logits, stride, V, asked, tokens, logprob, lse_out, top_keys, passes, TOP: tl.constexpr,
                     BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    r = tl.program_id(0)
    if tl.load(asked + r) >= 0:
        lp, lse, n = _score_row(logits + r.to(tl.int64) * stride, V, tl.load(tokens + r), top_keys + r * 2 * TOP,
                                TOP, BLOCK, PIVOTS)
        tl.store(lse_out + r, lse)
        tl.store(logprob + r, lp)
        tl.store(passes + r, n)


def fused_sample(
    logits: torch.Tensor,
    rows: SamplingRows,
    features: SamplerFeatures,
    vocab_hash: torch.Tensor,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    block: int = BLOCK,
    chunk: int = CHUNK,
) -> SampleOutput:
    """`blink.engine.core.sampler.sample` as kernels (vocab_hash is recomputed in them, from the ids). logits:
    float32 [R, V], rows contiguous; edited in place while the draw runs and given back raw. Rows whose request
    asked for no logprobs (rows.logprobs -1) get none."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "the kernels read float32 rows in place"
    edited = edits(rows, features, seen)
    raw = [logits.gather(1, ids.clamp(min=0)) for ids in edited]
    edit_logits(logits, rows, features, seen, counts)
    tokens, passes = _draw(logits, rows, block, chunk)
    for ids, values in zip(edited, raw, strict=True):
        logits.scatter_(1, ids.clamp(min=0), values)
    if not features.logprobs:
        return SampleOutput(tokens, None, None, None, passes)
    asked = rows.logprobs if rows.logprobs is not None else torch.zeros_like(tokens)
    *logprobs, scored = _logprobs(logits, asked, tokens, block)
    return SampleOutput(tokens, *logprobs, passes + scored)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, asked: torch.Tensor | None = None,
                   block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`blink.engine.core.sampler.token_logprobs` in one pass over each row that asked (asked >= 0; None: every
    row); the others get logprob 0 and top ids -1."""
    return _logprobs(logits, torch.zeros_like(tokens) if asked is None else asked, tokens, block)[:3]


def _draw(logits: torch.Tensor, rows: SamplingRows, block: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token, and the passes over its logits it took."""
    draw, passes = plan_draw(logits, rows, block, chunk)
    best = draw_chunks(logits, draw, chunk)
    return logits.shape[1] - 1 - (best.amax(1) & 0xFFFFFFFF), passes


def plan_draw(logits: torch.Tensor, rows: SamplingRows, block: int = BLOCK,
              chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, DRAW] each row's draw words (_plan_words'), its filters planned, and [R] the passes over its logits that
    the plan and the draw take."""
    R = logits.shape[0]
    draw = torch.empty(R, DRAW, dtype=torch.int32, device=logits.device)
    passes = torch.empty(R, dtype=torch.int32, device=logits.device)
    if R:
        _params_kernel[(R,)](rows.temperature, rows.min_p.log(), rows.top_k, rows.top_p, rows.seed, rows.step_index,
                             draw, passes, GREEDY_BELOW=GREEDY_BELOW, DRAW=DRAW)
        plan_filters(logits, draw, passes, tickets("sampler", logits.device, R), block, chunk)
    return draw, passes


def plan_filters(logits: torch.Tensor, draw: torch.Tensor, passes: torch.Tensor, ticket: torch.Tensor, block: int,
                 chunk: int) -> None:
    """The filtered rows' maxima and thresholds into their draw words (_plan_words' first), in one launch over
    chunks of `chunk` logits; each filtered row's passes grow by what it read."""
    R, V = logits.shape
    chunks = triton.cdiv(V, chunk)
    m = min(CANDIDATES, chunk)
    cand = torch.empty(R, chunks, m, dtype=torch.int32, device=logits.device)
    stats = torch.empty(R, chunks, 3, dtype=torch.float32, device=logits.device)  # max, sum of exp, key left out
    _plan_kernel[(R, chunks)](logits, logits.stride(0), V, draw, cand, stats, ticket, passes, CHUNK=chunk,
                              CHUNKS=triton.next_power_of_2(chunks), M=m, BINS=BINS, BLOCK=block, PIVOTS=PIVOTS,
                              DRAW=DRAW,
                              num_warps=max(1, min(8, chunk // 512)))


def draw_chunks(logits: torch.Tensor, draw: torch.Tensor, chunk: int) -> torch.Tensor:
    """[R, chunks] the best packed key of each chunk of each row's logits, by the row's planned draw (_plan_words'
    words in `draw`): the row's token is the largest's id."""
    R, V = logits.shape
    best = torch.empty(R, triton.cdiv(V, chunk), dtype=torch.int64, device=logits.device)
    if R:
        _draw_kernel[best.shape](logits, logits.stride(0), V, draw, best, CHUNK=chunk, DRAW=DRAW,
                                 num_warps=max(1, min(8, chunk // 512)))
    return best


def _logprobs(logits: torch.Tensor, asked: torch.Tensor, tokens: torch.Tensor,
              block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token's logprob and the top MAX_LOGPROBS of the rows that asked (asked >= 0), and the passes over its
    logits each row took."""
    R, V = logits.shape
    logprob = torch.zeros(R, dtype=torch.float32, device=logits.device)
    passes = torch.zeros(R, dtype=torch.int32, device=logits.device)
    lse = torch.zeros(R, dtype=torch.float32, device=logits.device)
    top = min(MAX_LOGPROBS, V)
    keys = torch.full((R, 2 * top), -(1 << 63), dtype=torch.int64, device=logits.device)
    if R:
        _logprobs_kernel[(R,)](logits, logits.stride(0), V, asked, tokens, logprob, lse, keys, passes,
                               TOP=top, BLOCK=block, PIVOTS=PIVOTS, num_warps=4)
    keys = keys.topk(top, dim=-1).values
    ordered = (keys >> 32).to(torch.int32)
    values = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(torch.float32)
    wanted = (asked >= 0)[:, None]
    return (logprob, torch.where(wanted, V - 1 - (keys & 0xFFFFFFFF), -1),
            torch.where(wanted, values - lse[:, None], 0.0), passes)

