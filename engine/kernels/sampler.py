"""The sampler as Triton kernels: each row's logits read as often as its own request needs, and no sort.

`fused_sample` is `blink.engine.core.sampler.sample` (the reference, which the CPU runs) for the device: the same
tokens for the same inputs. Each row pays for what its own request asked: a greedy row is one argmax pass; a row
that samples is one pass of noise and argmax; min-p, top-k and top-p add one pass that plans them; logprobs one
pass that scores them (blink.engine.kernels.logprobs). So a captured step that must serve every feature costs a
batch of greedy requests one pass, not the sort and the [rows, vocab] temporaries of the reference.

Both passes run over many programs a row (CHUNK logits each), so a batch of one fills the GPU rather than one of
its SMs. The draw (`_draw_chunk`) packs each chunk's best with its id, so the largest is torch's argmax; the chunks'
best are combined after (`_draw` here; the step sampler's finishing program there). The filters keep values, not
positions (as the reference does), so each is a threshold (blink.engine.kernels.thresholds): top-k keeps what has
fewer than k kept tokens above it, top-p what has less than top_p of the kept mass above it. The plan
(`_plan_kernel`) has each chunk hand in its highest keys, and the last of a row's programs searches the thresholds
among them, or the row whole where they cannot settle it. The sparse edits (logit biases, penalties, held tokens)
are the reference's own, done in place on the ids they name and undone after the draw, so the logits stay raw for
the logprobs.
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
from blink.engine.kernels.logprobs import logprobs
from blink.engine.kernels.thresholds import (
    BLOCK,
    CHUNK,
    LOWEST,
    NONE,
    PIVOTS,
    candidate_sizes,
    candidates,
    chunk_stats,
    from_key,
    hand_in,
    kept,
    mass,
    row_scratch,
    scaled,
    search,
    to_key,
    weigh,
)
from blink.engine.kernels.tickets import last_to_finish, tickets

DRAW = 8  # int32 words a row's planned draw takes in `draw` (_plan_words)
_MUL2 = tl.constexpr(0x846CA68B - (1 << 32))  # lowbias32's second multiplier as an int32 (products wrap as it wants)
_GOLDEN = tl.constexpr(0x9E3779B9 - (1 << 32))  # what noise_key mixes into the seed's high word, as an int32


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
def _plan_filters(row, V, at, cand, stats, chunks, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
                  CHUNKS: tl.constexpr, M: tl.constexpr):
    """A filtered row's maximum and top-k and top-p key floors, written to its draw words, from its chunks'
    candidates and sums. Every key above `low` (the highest a chunk left out) is a candidate, so a threshold with its
    limit's weight above `low` lies above it and is searched among the candidates; a limit that all the kept weight
    falls short of keeps everything, where the candidates hold all of it (whole). Otherwise the row is searched
    whole. Returns the passes over the row this took beyond the chunks' own."""
    T, lmp, k, p, _ = _filters(at)
    m, z, top, low = chunk_stats(stats, chunks, CHUNKS)
    N = chunks * M
    nothing = tl.full([], NONE, tl.int32)  # the floor that keeps everything
    whole = ~(from_key(low) - top >= lmp)  # min-p drops `low`, so every kept token is a candidate
    passes = tl.full([], 0, tl.int32)
    k_floor = nothing
    if (k > 0) & (k < V):  # a k past the vocabulary keeps everything
        over, _counted = weigh(cand, N, top, lmp, nothing, low, False, BLOCK)
        if over >= k:
            k_floor, _among = search(cand, N, 1.0, top, lmp, nothing, k.to(tl.float32), low, False, True, BLOCK,
                                      PIVOTS)
        elif ~whole:
            k_floor, passes = search(row, V, T, top, lmp, nothing, k.to(tl.float32), nothing.to(tl.int64) - 1, False,
                                      False, BLOCK, PIVOTS)
    p_floor = nothing
    if p < 1.0:
        whole = whole | (k_floor > low)
        over, total = weigh(cand, N, top, lmp, k_floor, low, True, BLOCK)
        if ~whole:  # nothing filtered before top-p, or the row is searched: the chunks' sums are the row's
            total = mass(m, z, top)
        if (whole | ((lmp == float("-inf")) & (k_floor == nothing))) & (over >= p * total):
            p_floor, _among = search(cand, N, 1.0, top, lmp, k_floor, p * total, low, True, True, BLOCK, PIVOTS)
        elif ~whole:
            p_floor, searched = search(row, V, T, top, lmp, k_floor, p, nothing.to(tl.int64) - 1, True, False, BLOCK,
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
    (hand_in); the last of them to finish (a ticket) plans the row's filters (_plan_filters). Other rows' programs do
    nothing: their words already keep everything."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    at = draw + r * DRAW
    T, _, _, _, filtered = _filters(at)
    if filtered:
        row = logits + r.to(tl.int64) * stride
        keys, _no_ids, sums = row_scratch(cand, cand, stats, r, chunks, M)
        hand_in(row, V, c, T, keys, keys, sums, CHUNK, M, BINS, False)  # keys, no ids
        if last_to_finish(tickets + r, chunks):
            searched = _plan_filters(row, V, at, keys, sums, chunks, BLOCK, PIVOTS, CHUNKS, M)
            tl.store(passes + r, tl.load(passes + r) + 1 + searched)


@triton.jit
def _draw_chunk(row, V, c, at, CHUNK: tl.constexpr):
    """The best of chunk c of a row's logits by its planned draw (`at`: _plan_words' words), as a packed key: the
    value's key, then the id reversed, so the largest is the highest value and, among equal ones, the lowest id
    (torch's argmax)."""
    T = tl.load(at + 0).to(tl.float32, bitcast=True)
    random = T > 0.0
    s, ids, real = scaled(row, c * CHUNK, V, tl.where(random, T, 1.0), CHUNK)
    if random:  # Gumbel-max over what the filters kept, with the reference's noise
        lmp = tl.load(at + 1).to(tl.float32, bitcast=True)
        top = tl.load(at + 2).to(tl.float32, bitcast=True)
        bits = _hash(tl.load(at + 5) ^ _hash(ids))
        u = (_shr(bits, 9).to(tl.float32) + 0.5) * (1.0 / (1 << 23))
        keep = kept(s, top, lmp, tl.load(at + 3)) & (to_key(s) >= tl.load(at + 4)) & (s > float("-inf"))
        s = tl.where(keep, s - tl.log(-tl.log(u)), float("-inf"))
    packed = tl.where(real, (to_key(s).to(tl.int64) << 32) | (V - 1 - ids).to(tl.int64), LOWEST)
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
    *scores, scored = logprobs(logits, asked, tokens, block, chunk)
    return SampleOutput(tokens, *scores, passes + scored)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, asked: torch.Tensor | None = None,
                   block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`blink.engine.core.sampler.token_logprobs` in one pass over each row that asked (asked >= 0; None: every
    row); the others get logprob 0 and top ids -1."""
    return logprobs(logits, torch.zeros_like(tokens) if asked is None else asked, tokens, block)[:3]


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
    cand, _, stats = candidates(R, V, chunk, logits.device, ids=False)
    _plan_kernel[(R, triton.cdiv(V, chunk))](logits, logits.stride(0), V, draw, cand, stats, ticket, passes,
                                             **candidate_sizes(V, chunk), BLOCK=block, PIVOTS=PIVOTS, DRAW=DRAW,
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
