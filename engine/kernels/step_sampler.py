"""The step's sampling in up to five launches, read from the slot state by each row's slot: which batch rows the
output embedding reads, every row's edits, the filters' plan, the draw, the logprobs and prompt scores
(engine/core/step.py runs the torch reference's gathers and `sample` instead where no kernels are set).

`_rows_kernel` (one program) lays out the rows whose logits the step computes: the sampling rows' batch tokens,
then the prompt tokens scored this step (engine/core/step.py `_prompt_tokens`, packed), their slots and the prompt
token each scores (engine/core/commit.py `score_prompt`), and where each slot's run of them starts.

Then, for a sampling row, what `blink.engine.core.sampler.sample` does: `_edit_kernel` (a program per row) loads its
parameters from the state at its slot, writes the sparse edits (logit bias, penalties over the tokens its sequence
holds, min_tokens' held ids) in place into its own logits row and writes its draw's words; a filtered row's
thresholds are then planned (blink.engine.kernels.sampler `plan_filters`). The last launches run over chunks of the
vocabulary, many programs a row, the last of a row's programs to finish (a ticket, as split attention merges)
finishing it: `_draw_finish_kernel` takes the best chunk's token and gives the row back raw; `_score_kernel` scores
the logprobs a row asked for (of its token, or of the prompt token a prompt row is given), the top sorted in the
kernel. The edits save each id's raw value first, in a scratch row as long as the context (sized, not read, past the
sequence), so repeated ids are rewritten from their raw value, never twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from blink.engine.core.sampler import GREEDY_BELOW, SampleOutput, Sampler, SamplerFeatures
from blink.engine.kernels.logprobs import score_part, score_sizes
from blink.engine.kernels.sampler import (
    DRAW,
    _draw_chunk,
    _noise_key,
    _plan_words,
    fused_sample,
    plan_filters,
    token_logprobs,
)
from blink.engine.kernels.thresholds import BLOCK, CHUNK, LOWEST, PIVOTS, candidates, from_key, row_scratch
from blink.engine.kernels.tickets import last_to_finish, tickets
from blink.shared.request_schema import MAX_LOGIT_BIAS, MAX_STOP_IDS

if TYPE_CHECKING:
    from blink.engine.core.commit import PromptScores
    from blink.engine.core.scheduler import StepPlan
    from blink.engine.core.state import Slots

SEEN_BLOCK = 64  # sequence tokens a program penalises at a time
LAYOUT_BLOCK = 256  # batch tokens the layout reads at a time


@triton.jit
def _rows_kernel(sample_token, R, token_slot, token_pos, token_valid, B, num_computed, scored, entries, S, tokens,
                 tokens_stride, max_len, rows_read, prompt_slot, prompt_token, first, P,
                 BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    start = tl.full([], 0, tl.int32)
    while start < R:
        at = start + i
        tl.store(rows_read + at, tl.load(sample_token + at, mask=at < R), mask=at < R)
        start += BLOCK
    # The prompt tokens scored this step, in batch order: from each slot's first unscored position, its entries.
    packed = tl.full([], 0, tl.int32)
    start = tl.full([], 0, tl.int32)
    while start < B:
        b = start + i
        inside = b < B
        slot = tl.load(token_slot + b, mask=inside, other=0)
        pos = tl.load(token_pos + b, mask=inside, other=0)
        begin = tl.maximum(tl.load(num_computed + slot, mask=inside, other=0), tl.load(scored + slot, mask=inside,
                                                                                          other=0))
        scores = inside & (tl.load(token_valid + b, mask=inside, other=0) != 0) & (pos >= begin) & \
            (pos < begin + tl.load(entries + slot, mask=inside, other=0))
        at = packed + tl.cumsum(scores.to(tl.int32), 0) - 1
        tl.store(rows_read + R + at, b.to(tl.int64), mask=scores & (at < P))
        packed += tl.sum(scores.to(tl.int32), 0)
        start += BLOCK
    # Each slot's first row (its entries' running sum before it), and how many rows are real.
    total = tl.full([], 0, tl.int64)
    start = tl.full([], 0, tl.int32)
    while start < S:
        s = start + i
        count = tl.load(entries + s, mask=s < S, other=0)
        tl.store(first + s, total + tl.cumsum(count, 0) - count, mask=s < S)
        total += tl.sum(count, 0)
        start += BLOCK
    start = tl.full([], 0, tl.int32)
    while start < P:  # the rest read batch token 0, as pack leaves them
        at = start + i
        tl.store(rows_read + R + at, tl.zeros([BLOCK], tl.int64), mask=(at >= packed) & (at < P))
        start += BLOCK
    tl.debug_barrier()  # what other threads packed, read back
    start = tl.full([], 0, tl.int32)
    while start < P:
        at = start + i
        inside = at < P
        b = tl.load(rows_read + R + at, mask=inside, other=0)
        slot = tl.load(token_slot + b, mask=inside, other=0)
        after = tl.minimum(tl.load(token_pos + b, mask=inside, other=0) + 1, max_len)
        tl.store(prompt_token + at, tl.load(tokens + slot * tokens_stride + after, mask=inside).to(tl.int64),
                 mask=inside)
        tl.store(prompt_slot + at, tl.where(at < total, slot, -1), mask=inside)
        start += BLOCK


@triton.jit
def _log_min_p(min_p):
    """log(min_p), -inf for 0 (the reference's log), without taking the log of 0."""
    return tl.where(min_p > 0.0, tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))


@triton.jit
def _save(row, ids, saved, used):
    tl.store(saved, tl.load(row + ids, mask=used, other=0.0), mask=used)


@triton.jit
def _row_edits(r, sample_slot, sample_token, token_pos, prompt_len, seq_len, repetition, presence, frequency,
               min_tokens, ignore_eos, stop_ids, bias_ids, bias, eos_ids, E, PENALTIES: tl.constexpr,
               BIAS: tl.constexpr, HOLD: tl.constexpr, NB: tl.constexpr, NS: tl.constexpr, NE: tl.constexpr):
    """A sampling row's slot, its token's step index, and the sparse edits its request asks of its logits: the
    sequence's length and penalties (penalise: any), the biased ids (biased: any), and the ids held back while it
    is young (eos unless ignored, the stop ids)."""
    slot = tl.load(sample_slot + r)
    step_index = tl.load(token_pos + tl.load(sample_token + r)) + 1 - tl.load(prompt_len + slot)
    seen_n = tl.load(seq_len + slot)
    rep, pres, freq = tl.load(repetition + slot), tl.load(presence + slot), tl.load(frequency + slot)
    penalise = PENALTIES & (seen_n > 0) & ((rep != 1.0) | (pres != 0.0) | (freq != 0.0))
    b_ids = tl.load(bias_ids + slot * NB + tl.arange(0, NB))
    b = tl.load(bias + slot * NB + tl.arange(0, NB))
    biased = BIAS & (tl.max(b_ids, 0) >= 0)
    young = HOLD & (step_index < tl.load(min_tokens + slot))
    e = tl.arange(0, NE)
    eos = tl.load(eos_ids + e, mask=(e < E) & (tl.load(ignore_eos + slot) == 0), other=-1)
    stops = tl.load(stop_ids + slot * NS + tl.arange(0, NS))
    return slot, step_index, seen_n, rep, pres, freq, penalise, b_ids, b, biased, young, eos, stops


@triton.jit
def _edit_kernel(
        logits, stride, V, sample_slot, sample_token, token_pos,
        temperature, top_p, top_k, min_p, repetition, presence, frequency, seed, prompt_len, min_tokens, ignore_eos,
        seq_len, tokens, tokens_stride, counts, counts_stride, stop_ids, bias_ids, bias, eos_ids, E,
        saved, saved_stride, draw, passes,
        RANDOM: tl.constexpr, PENALTIES: tl.constexpr, BIAS: tl.constexpr, HOLD: tl.constexpr, NB: tl.constexpr,
        NS: tl.constexpr, NE: tl.constexpr, SEEN: tl.constexpr, GREEDY_BELOW: tl.constexpr, DRAW: tl.constexpr):
    """A sampling row's edits written into its logits (their raw values saved first), then its draw's words."""
    r = tl.program_id(0)
    row = logits + r.to(tl.int64) * stride
    slot, step_index, seen_n, rep, pres, freq, penalise, b_ids, b, biased, young, eos, stops = _row_edits(
        r, sample_slot, sample_token, token_pos, prompt_len, seq_len, repetition, presence, frequency, min_tokens,
        ignore_eos, stop_ids, bias_ids, bias, eos_ids, E, PENALTIES, BIAS, HOLD, NB, NS, NE)
    save = saved + r.to(tl.int64) * saved_stride  # [seen | biased | held] raw values
    seen_at = tokens + slot * tokens_stride
    # 1: every id's raw value, before any edit.
    if biased:
        _save(row, b_ids, save + seen_n + tl.arange(0, NB), b_ids >= 0)
    if penalise:
        start = tl.full([], 0, tl.int64)
        while start < seen_n:
            i = start + tl.arange(0, SEEN)
            t = tl.load(seen_at + i, mask=i < seen_n, other=-1)
            _save(row, t, save + i, t >= 0)
            start += SEEN
    if young:
        _save(row, eos, save + seen_n + NB + tl.arange(0, NE), eos >= 0)
        _save(row, stops, save + seen_n + NB + NE + tl.arange(0, NS), stops >= 0)
    tl.debug_barrier()
    # 2: the biases (repeated ids add up, as scatter_add does), then the penalties from each id's raw value plus
    # its bias, then the held ids: the reference's order.
    if biased:
        tl.atomic_add(row + b_ids, b, mask=b_ids >= 0)
    tl.debug_barrier()
    if penalise:
        start = tl.full([], 0, tl.int64)
        while start < seen_n:
            i = start + tl.arange(0, SEEN)
            t = tl.load(seen_at + i, mask=i < seen_n, other=-1)
            x = tl.load(save + i, mask=t >= 0, other=0.0)
            if biased:
                x += tl.sum(tl.where(t[:, None] == b_ids[None, :], b[None, :], 0.0), 1)
            c = tl.load(counts + slot * counts_stride + t, mask=t >= 0, other=0).to(tl.float32)
            x = tl.where(x > 0, tl.div_rn(x, rep), x * rep) - freq * c - pres * (c > 0).to(tl.float32)
            tl.store(row + t, x, mask=t >= 0)
            start += SEEN
    tl.debug_barrier()
    if young:
        tl.store(row + eos, tl.full([NE], float("-inf"), tl.float32), mask=eos >= 0)
        tl.store(row + stops, tl.full([NS], float("-inf"), tl.float32), mask=stops >= 0)
    tl.debug_barrier()
    T = tl.where(RANDOM, tl.load(temperature + slot), 0.0)
    _plan_words(tl.where(T >= GREEDY_BELOW, T, 0.0), _log_min_p(tl.load(min_p + slot)), tl.load(top_k + slot),
                tl.load(top_p + slot), _noise_key(tl.load(seed + slot), step_index), draw + r * DRAW)
    tl.store(passes + r, 1)  # the draw's; plan_filters adds its own


@triton.jit
def _draw_finish_kernel(
        logits, stride, V, sample_slot, sample_token, token_pos, repetition, presence, frequency, prompt_len,
        min_tokens, ignore_eos, seq_len, tokens, tokens_stride, stop_ids, bias_ids, bias, eos_ids, E, saved,
        saved_stride, draw, best, tickets, out_token,
        PENALTIES: tl.constexpr, BIAS: tl.constexpr, HOLD: tl.constexpr, NB: tl.constexpr, NS: tl.constexpr,
        NE: tl.constexpr, SEEN: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, DRAW: tl.constexpr):
    """Grid: sampling rows x chunks of the vocabulary. A row's programs draw a chunk each; the last of them to finish
    (a ticket) takes the best chunk's token and gives the row back raw (its edited ids' saved values)."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    row = logits + r.to(tl.int64) * stride
    tl.store(best + r * chunks + c, _draw_chunk(row, V, c, draw + r * DRAW, CHUNK))
    if last_to_finish(tickets + r, chunks):
        slot, _, seen_n, _, _, _, penalise, b_ids, _, biased, young, eos, stops = _row_edits(
            r, sample_slot, sample_token, token_pos, prompt_len, seq_len, repetition, presence, frequency,
            min_tokens, ignore_eos, stop_ids, bias_ids, bias, eos_ids, E, PENALTIES, BIAS, HOLD, NB, NS, NE)
        each = tl.arange(0, CHUNKS)
        token = V - 1 - (tl.max(tl.load(best + r * chunks + each, mask=each < chunks, other=LOWEST,
                                        cache_modifier=".cg"), 0) & 0xFFFFFFFF)
        tl.store(out_token + r, token.to(tl.int64))
        save = saved + r.to(tl.int64) * saved_stride
        seen_at = tokens + slot * tokens_stride
        # 3: the row given back raw (repeated ids write the same value).
        if biased:
            tl.store(row + b_ids, tl.load(save + seen_n + tl.arange(0, NB)), mask=b_ids >= 0)
        if penalise:
            start = tl.full([], 0, tl.int64)
            while start < seen_n:
                i = start + tl.arange(0, SEEN)
                t = tl.load(seen_at + i, mask=i < seen_n, other=-1)
                tl.store(row + t, tl.load(save + i, mask=t >= 0), mask=t >= 0)
                start += SEEN
        if young:
            tl.store(row + eos, tl.load(save + seen_n + NB + tl.arange(0, NE)), mask=eos >= 0)
            tl.store(row + stops, tl.load(save + seen_n + NB + NE + tl.arange(0, NS)), mask=stops >= 0)


@triton.jit
def _score_kernel(
        logits, stride, V, R, sample_slot, asked, out_token, prompt_slot, prompt_token, cand, ids, stats, tickets,
        out_logprob, top_ids, top_logprobs, top_keys, passes,
        LOGPROBS: tl.constexpr, TOP: tl.constexpr, TOP_ROOM: tl.constexpr, CELLS: tl.constexpr,
        CHUNK: tl.constexpr, CHUNKS: tl.constexpr, M: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr,
        PIVOTS: tl.constexpr):
    """Grid: logits rows x chunks of the vocabulary. The logprobs of a sampling row that asked (of its drawn token)
    and of a scored prompt row (of the token it is given) over many programs a row (score_part), the top sorted
    here by the last of them; the other rows' first program writes that they have none."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    if r < R:
        wanted = LOGPROBS & (tl.load(asked + tl.load(sample_slot + r)) >= 0)
        token = tl.load(out_token + r)
    else:
        wanted = tl.load(prompt_slot + r - R) >= 0
        token = tl.load(prompt_token + r - R).to(tl.int64)
    top = tl.arange(0, TOP_ROOM)
    listed = top < TOP
    if wanted:
        keys = top_keys + r.to(tl.int64) * CELLS
        row_keys, row_ids, row_sums = row_scratch(cand, ids, stats, r, chunks, M)
        last, logprob, lse, n = score_part(logits + r.to(tl.int64) * stride, V, c, chunks, token, row_keys, row_ids,
                                           row_sums, tickets + r, keys, TOP, CELLS, CHUNK, CHUNKS, M, BINS, BLOCK,
                                           PIVOTS)
        if last:
            tl.debug_barrier()
            cells = tl.arange(0, CELLS)
            ordered = tl.sort(tl.load(keys + cells), descending=True)
            tl.debug_barrier()
            tl.store(keys + cells, ordered)
            tl.debug_barrier()
            # The first TOP of the sorted keys: their ids, and their logits less the log-sum-exp.
            first = tl.load(keys + top, mask=listed, other=0)
            tl.store(top_ids + r * TOP + top, V - 1 - (first & 0xFFFFFFFF), mask=listed)
            tl.store(top_logprobs + r * TOP + top, from_key((first >> 32).to(tl.int32)) - lse, mask=listed)
            tl.store(out_logprob + r, logprob)
            tl.store(passes + r, tl.where(r < R, tl.load(passes + r, mask=r < R, other=0), 0) + n)
    elif c == 0:
        tl.store(top_ids + r * TOP + top, tl.full([TOP_ROOM], -1, tl.int64), mask=listed)
        tl.store(top_logprobs + r * TOP + top, tl.zeros([TOP_ROOM], tl.float32), mask=listed)
        tl.store(out_logprob + r, 0.0)
        if r >= R:
            tl.store(passes + r, 0)


@dataclass(frozen=True)
class StepKernels:
    """The step's sampling as kernels (engine/core/step.py calls them when its sampler has them); block: logits a
    row's own program reads at a time; chunk: logits each of the draw's programs reads."""

    block: int = BLOCK
    chunk: int = CHUNK

    def rows_read(self, state: Slots, plan: StepPlan, tokens: int, rows: int,
                  prompt_rows: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The batch rows whose logits the step computes ([rows + prompt_rows]: the sampling rows', then the prompt
        tokens scored), and the prompt rows' layout (for `sample`)."""
        if not prompt_rows:
            return plan.sample_token[:rows], None
        device = plan.sample_token.device
        read = torch.empty(rows + prompt_rows, dtype=torch.int64, device=device)
        slot, token = (torch.empty(prompt_rows, dtype=torch.int64, device=device) for _ in range(2))
        first = torch.empty_like(plan.prompt_entries)
        _rows_kernel[(1,)](plan.sample_token, rows, plan.token_slot, plan.token_pos, plan.token_valid, tokens,
                           state.num_computed, state.scored, plan.prompt_entries, state.num_slots, state.tokens,
                           state.tokens.stride(0), state.max_len, read, slot, token, first, prompt_rows,
                           BLOCK=LAYOUT_BLOCK, num_warps=4)
        return read, (slot, token, first)

    def reserve(self, device: torch.device, rows: int = 1) -> torch.Tensor:
        """The tickets a row's draw hands its finish by, held from step to step: allocated at the first call (the
        device modes' first run of each bucket, before capture; a count of a step's launches, before it counts)."""
        return tickets("step sampler", device, rows)

    def sample(self, logits: torch.Tensor, state: Slots, plan: StepPlan, rows: int, prompt: tuple | None,
               features: SamplerFeatures, eos_ids: torch.Tensor) -> tuple[SampleOutput, PromptScores | None]:
        """logits: float32 [rows + prompt rows, V] (rows_read's), given back raw. Each sampling row's token, and
        its logprobs where its request asked; the prompt rows' scores."""
        from blink.engine.core.commit import PromptScores

        assert logits.dtype == torch.float32 and logits.stride(1) == 1, "the kernel reads float32 rows in place"
        n, V = logits.shape
        device = logits.device
        sizes = score_sizes(V, self.chunk)
        top = sizes["TOP"]
        token = torch.empty(n, dtype=torch.int64, device=device)
        logprob = torch.empty(n, dtype=torch.float32, device=device)
        passes = torch.empty(n, dtype=torch.int32, device=device)
        top_ids = torch.empty(n, top, dtype=torch.int64, device=device)
        top_logprobs = torch.empty(n, top, dtype=torch.float32, device=device)
        keys = torch.empty(n, sizes["CELLS"], dtype=torch.int64, device=device)
        # The edited ids' raw values: the sequence's tokens, the biased ids, eos and the stop ids.
        width = state.max_len + MAX_LOGIT_BIAS + triton.next_power_of_2(eos_ids.numel()) + MAX_STOP_IDS
        saved = torch.empty(rows, width, dtype=torch.float32, device=device)
        no_prompt = prompt is None
        slot, prompt_token, first = (token, token, None) if no_prompt else prompt
        draw = torch.empty(rows, DRAW, dtype=torch.int32, device=device)
        chunks = triton.cdiv(V, self.chunk)
        best = torch.empty(rows, chunks, dtype=torch.int64, device=device)  # each chunk's best packed key
        ticket = self.reserve(device, n)  # each launch's last programs leave them at zero for the next
        edit_flags = dict(PENALTIES=features.penalties, BIAS=features.logit_bias, HOLD=features.min_tokens,
                          NB=MAX_LOGIT_BIAS, NS=MAX_STOP_IDS, NE=triton.next_power_of_2(eos_ids.numel()),
                          SEEN=SEEN_BLOCK)
        warps = max(1, min(8, self.chunk // 512))

        def launch() -> None:
            if rows:
                _edit_kernel[(rows,)](
                    logits, logits.stride(0), V, plan.sample_slot, plan.sample_token, plan.token_pos,
                    state.temperature, state.top_p, state.top_k, state.min_p, state.repetition_penalty,
                    state.presence_penalty, state.frequency_penalty, state.seed, state.prompt_len, state.min_tokens,
                    state.ignore_eos, state.seq_len, state.tokens, state.tokens.stride(0), state.output_counts,
                    state.output_counts.stride(0), state.stop_ids, state.logit_bias_ids, state.logit_bias, eos_ids,
                    eos_ids.numel(), saved, width, draw, passes, RANDOM=features.random, GREEDY_BELOW=GREEDY_BELOW,
                    DRAW=DRAW, **edit_flags, num_warps=4,
                    enable_fp_fusion=False)  # the penalties rounded as the reference's ops, x - f * c not fused
                if features.random and features.filtering:
                    plan_filters(logits[:rows], draw, passes, ticket, self.block, self.chunk)
                _draw_finish_kernel[(rows, chunks)](
                    logits, logits.stride(0), V, plan.sample_slot, plan.sample_token, plan.token_pos,
                    state.repetition_penalty, state.presence_penalty, state.frequency_penalty, state.prompt_len,
                    state.min_tokens, state.ignore_eos, state.seq_len, state.tokens, state.tokens.stride(0),
                    state.stop_ids, state.logit_bias_ids, state.logit_bias, eos_ids, eos_ids.numel(), saved, width,
                    draw, best, ticket, token, CHUNK=self.chunk, CHUNKS=triton.next_power_of_2(chunks), DRAW=DRAW,
                    **edit_flags, num_warps=warps)
            if features.logprobs or not no_prompt:
                _score_kernel[(n, chunks)](
                    logits, logits.stride(0), V, rows, plan.sample_slot, state.logprobs, token, slot, prompt_token,
                    *candidates(n, V, self.chunk, device, ids=True), ticket, logprob, top_ids, top_logprobs, keys,
                    passes,
                    LOGPROBS=features.logprobs, TOP_ROOM=triton.next_power_of_2(top), BLOCK=self.block, PIVOTS=PIVOTS,
                    **sizes, num_warps=warps)

        if n:
            _run(logits, passes, launch)
        logprobs = (logprob[:rows], top_ids[:rows], top_logprobs[:rows]) if features.logprobs else (None,) * 3
        out = SampleOutput(token[:rows], *logprobs, passes[:rows])
        if no_prompt:
            return out, None
        count = plan.prompt_entries
        return out, PromptScores(slot, prompt_token, logprob[rows:], top_ids[rows:], top_logprobs[rows:], first,
                                 count)


def _run(logits: torch.Tensor, passes: torch.Tensor, launch: Callable[[], None]) -> None:
    """The step's sampling launches over `logits`; each row's passes over its logits are left in `passes` (what
    `blink bench step` counts the bytes by)."""
    launch()


# The GPU's sampler: the fused kernels for `sample`'s and `token_logprobs`' arguments, and the step's own.
FUSED_SAMPLER = Sampler(fused_sample, token_logprobs, StepKernels())
