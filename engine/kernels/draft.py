"""The drafts' proposal as two Triton kernels: blink.engine.core.speculation.Speculation.draft (the torch reference:
which slots may and want to draft by the step-cost fit, the n-gram search over each slot's history, the drafts cut to
the budget and the free pages in the budget's order; about 170 small ops, a kernel each in a captured step) in two
launches. `_propose`, a program per slot: the step's sums (every program reads the slots' few words: no second
launch to share them), the slot's threshold, the search over its own history, in blocks up to its own length (the
latest earlier occurrence of its last n tokens, the longest n in [lookup_min, lookup_max]), then the retry and earned
cap by its rate for that n. `_fit`, one program: the budget's order, the tokens and pages left, the drafts copied after
each sequence and the match length they followed. A draft model's drafts (LOOKUP and COPY off): no search, no copy.
tests/engine/test_draft_kernel.py holds them to the reference."""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from blink.engine.core.kv_cache import PagePool
from blink.engine.core.policy import POLICIES, Policy, StepCost
from blink.engine.core.state import Slots

SLO = tl.constexpr(POLICIES.index("slo"))  # the one policy with latency-sensitive slots (Policy.latency_sensitive)
HISTORY_BLOCK = 256  # history positions a program compares at a time


@triton.jit
def _able(i, real, live, take, seq_len, computed, max_tokens, repetition, presence, frequency, prompt_logprobs,
          scored, prompt_len, draft_off):
    """Speculation.draft's `able`: decoding one token, with no penalty, no prompt left to score, not held off."""
    seq = tl.load(seq_len + i, mask=real, other=0)
    decoding = ((tl.load(live + i, mask=real, other=0) != 0) & (tl.load(take + i, mask=real, other=0) == 1)
                & (seq - tl.load(computed + i, mask=real, other=0) == 1) & (tl.load(max_tokens + i, mask=real,
                                                                                     other=0) > 0))
    penalised = ((tl.load(repetition + i, mask=real, other=1.0) != 1) | (tl.load(presence + i, mask=real, other=0.0)
                                                                         != 0)
                 | (tl.load(frequency + i, mask=real, other=0.0) != 0))
    scoring = ((tl.load(prompt_logprobs + i, mask=real, other=-1) >= 0)
               & (tl.load(scored + i, mask=real, other=0) < tl.load(prompt_len + i, mask=real, other=0) - 1))
    return real & decoding & ~penalised & ~scoring & (tl.load(draft_off + i, mask=real, other=1) == 0)


@triton.jit
def _latest_match(able, seq, history, lookup_min, LOOKUP_MAX: tl.constexpr, BLOCK_J: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Speculation.propose for one slot: (the longest n in range whose last n tokens occur earlier, 0 for none; the
    latest such occurrence's last index), from latest[n - 1], the last j < seq - 1 where the last n tokens end too."""
    n = tl.arange(0, BLOCK_N) + 1
    latest = tl.full((BLOCK_N,), -1, tl.int64)
    # Its own history only, in blocks (a while loop: Triton 3.6's interpreter takes no loaded bound in a range).
    end = tl.where(able, seq - 1, 0)
    j0 = 0
    while j0 < end:
        j = j0 + tl.arange(0, BLOCK_J)
        run = j < seq - 1
        length = tl.zeros((BLOCK_J,), tl.int32)  # how many of the last tokens match, ending at j
        for d in tl.static_range(LOOKUP_MAX):
            last = tl.load(history + tl.maximum(seq - 1 - d, 0))
            run = run & (j >= d)
            run = run & (tl.load(history + j - d, mask=run, other=0) == last)
            length += run.to(tl.int32)
        at = tl.where(length[:, None] >= n[None, :], j[:, None].to(tl.int64), -1)
        latest = tl.maximum(latest, tl.max(at, 0))
        j0 += BLOCK_J
    # The longest n in range with an earlier occurrence wins; the draft is what followed it, K tokens at most.
    fits = (n >= lookup_min) & (n <= LOOKUP_MAX) & (latest >= 0) & (seq >= n)
    best = tl.max(tl.where(fits, n, 0), 0)
    return best, tl.sum(tl.where(n == best, latest, 0), 0)


@triton.jit(do_not_specialize=["S", "max_len", "share_bits", "ratio_bits", "lookup_min"])
def _propose(live, take, seq_len, computed, max_tokens, repetition, presence, frequency, prompt_logprobs, scored,
             prompt_len, draft_off, service_class, spec_rate, rates_stride, room, cost, tokens, tokens_stride,
             wanted_out, start_out, match_out, S, max_len, share_bits, ratio_bits, lookup_min, RETRY, MIN_RATE,
             K: tl.constexpr, LOOKUP: tl.constexpr, LOOKUP_MAX: tl.constexpr, POLICY: tl.constexpr,
             BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.program_id(0)
    able = _able(s, s < S, live, take, seq_len, computed, max_tokens, repetition, presence, frequency,
                 prompt_logprobs, scored, prompt_len, draft_off)
    # Speculation.threshold: what a draft costs by the fit, times the drafts its kind's slots would add.
    i = tl.arange(0, BLOCK_S)
    real = i < S
    takes = tl.load(take + i, mask=real, other=0)
    ends = tl.load(computed + i, mask=real, other=0) + takes
    sampling = tl.sum(((takes > 0) & (ends == tl.load(seq_len + i, mask=real, other=0))).to(tl.int64), 0)
    per_step, per_token = tl.load(cost), tl.load(cost + 1)
    step = per_step + per_token * tl.sum(takes, 0).to(tl.float64)
    share = share_bits.to(tl.float64, bitcast=True)  # token_share, a float64 passed bit for bit
    ratio = ratio_bits.to(tl.float64, bitcast=True)  # draft_ratio, likewise
    per_draft = tl.where(step > 0, per_token * share / tl.maximum(step, tl.full((), 1e-12, tl.float64)), 0.0)
    forward = tl.where(step > 0, per_step * ratio / tl.maximum(step, tl.full((), 1e-12, tl.float64)), 0.0)
    drafting = sampling
    if POLICY == SLO:  # a latency-sensitive slot counts the able slots of its kind, not the batch
        sensitive = tl.load(service_class + i, mask=real, other=1) == 0
        mates = _able(i, real, live, take, seq_len, computed, max_tokens, repetition, presence, frequency,
                      prompt_logprobs, scored, prompt_len, draft_off) & sensitive
        own = tl.load(service_class + s) == 0
        drafting = tl.where(own, tl.sum(mates.to(tl.int64), 0), sampling)
    need = per_draft * tl.maximum(drafting.to(tl.float64), 1.0) + forward

    seq = tl.load(seq_len + s)
    if LOOKUP:
        best, end = _latest_match(able, seq, tokens + s.to(tl.int64) * tokens_stride, lookup_min, LOOKUP_MAX,
                                  BLOCK_J, BLOCK_N)
        found = tl.where(best > 0, tl.minimum(seq - end - 1, K), 0)
    else:  # a draft model's drafts (Speculation.lookup off): K for any able slot, under the rate of column 0
        best = able.to(tl.int32)
        end = seq * 0 - 1  # start 0, as the reference's (seq * 0: int64, as the search's results)
        found = tl.where(able, seq * 0 + K, 0)
    # The slot's rate for drafts after a match of this length: a short match's drafts fail more often.
    rates = spec_rate + s.to(tl.int64) * rates_stride
    column = tl.maximum(best - 1, 0)
    rate = tl.load(rates + column)
    matched = able & (best > 0)
    need = tl.maximum(need.to(tl.float32), MIN_RATE)
    wants = matched & (rate >= need)
    if matched & ~wants:  # a slot not drafting regains some rate, so it tries again after a while
        tl.store(rates + column, rate + RETRY * (1 - rate))
    k = tl.minimum(found, tl.load(max_tokens + s) - (seq - tl.load(prompt_len + s)) - 1)
    k = tl.minimum(k, max_len - seq - 1)
    # As deep as a draft token pays: the j-th is kept about rate**j of the time (float32 products, as the reference).
    depth = tl.full((), 1, tl.int64)
    kept = rate * rate
    for _ in tl.static_range(K - 1):
        depth += (kept >= need).to(tl.int64)
        kept = kept * rate
    k = tl.minimum(tl.minimum(k, tl.load(room + s) - 1), depth)
    k = tl.minimum(tl.maximum(tl.where(wants, k, 0), 0), K)
    tl.store(wanted_out + s, k)
    tl.store(start_out + s, tl.where(best > 0, end + 1, 0))
    tl.store(match_out + s, tl.where(able, best, -1))  # -1: not able (no slot able: draft_n kept, as the reference)


@triton.jit(do_not_specialize=["S", "page"])
def _fit(order, wanted, start, match, take, seq_len, computed, pages_held, num_free, cap, tokens, tokens_stride,
         draft_len, draft_n, k_out, S, page, COPY: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """Speculation._fit, in the budget's order, then the drafts copied after each sequence and the match lengths
    they followed (where some slot was able to draft: else the reference returns before)."""
    o = tl.arange(0, BLOCK_S)
    real = o < S
    slot = tl.load(order + o, mask=real, other=0)
    want = tl.load(wanted + slot, mask=real, other=0)
    takes = tl.load(take + slot, mask=real, other=0)
    left = tl.load(cap) - tl.sum(takes, 0)
    k = tl.minimum(tl.maximum(left - (tl.cumsum(want, 0) - want), 0), want)
    ends = tl.load(computed + slot, mask=real, other=0) + takes
    had = tl.load(pages_held + slot, mask=real, other=0)
    held = tl.maximum(had, (ends + page - 1) // page)
    base = tl.sum(tl.where(takes > 0, held - had, 0), 0)
    extra = tl.maximum((ends + k + page - 1) // page - held, 0)
    k = tl.where(tl.cumsum(extra, 0) + base <= tl.load(num_free), k, 0)
    tl.store(k_out + slot, k, mask=real)
    tl.store(draft_len + slot, k, mask=real)
    n = tl.load(match + slot, mask=real, other=-1)
    tl.store(draft_n + slot, tl.where(k > 0, n, 0), mask=real & (tl.max(n, 0) >= 0))
    if COPY:  # looked up (a draft model writes its own in the step)
        # The drafts follow an earlier occurrence, so they are read before the sequence's end, written after it.
        c = tl.arange(0, BLOCK_K)[None, :]
        copy = real[:, None] & (c < k[:, None])
        history = tokens + slot.to(tl.int64)[:, None] * tokens_stride
        drafts = tl.load(history + tl.load(start + slot, mask=real, other=0)[:, None] + c, mask=copy, other=0)
        tl.store(history + tl.load(seq_len + slot, mask=real, other=0)[:, None] + c, drafts, mask=copy)


def draft(speculation, state: Slots, pool: PagePool, policy: Policy, cost: StepCost, take: torch.Tensor,
          live: torch.Tensor, order: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Speculation.draft's arguments (the speculation first), effects and result: [S] draft tokens each slot
    computes on top of `take`, written after its sequence in state.tokens, with state.draft_len, state.draft_n and
    the retrying slots' state.spec_rate."""
    from blink.engine.core.speculation import MIN_RATE, RETRY

    S, device = state.num_slots, take.device
    wanted, start, match, k = (torch.empty(S, dtype=torch.int64, device=device) for _ in range(4))
    block_s = triton.next_power_of_2(S)
    # Float64s passed bit for bit; a zero ratio as -0.0 (the same sums), since 0's bits would pass as an int32.
    share_bits, ratio_bits = (struct.unpack("<q", struct.pack("<d", x))[0]
                              for x in (speculation.token_share, speculation.draft_ratio or -0.0))
    _propose[(S,)](live, take, state.seq_len, state.num_computed, state.max_tokens, state.repetition_penalty,
                   state.presence_penalty, state.frequency_penalty, state.prompt_logprobs, state.scored,
                   state.prompt_len, state.draft_off, state.service_class, state.spec_rate, state.spec_rate.stride(0),
                   state.room, cost.values, state.tokens, state.tokens.stride(0), wanted, start, match, S,
                   state.max_len, share_bits, ratio_bits, speculation.lookup_min, RETRY, MIN_RATE,
                   K=speculation.k, LOOKUP=speculation.lookup, LOOKUP_MAX=speculation.lookup_max,
                   POLICY=POLICIES.index(policy.name), BLOCK_S=block_s, BLOCK_J=HISTORY_BLOCK,
                   BLOCK_N=triton.next_power_of_2(speculation.lookup_max),
                   enable_fp_fusion=False)  # the reference's roundings: a * b + c not fused (the threshold, the retry)
    _fit[(1,)](order, wanted, start, match, take, state.seq_len, state.num_computed, state.pages_held, pool.num_free,
               cap, state.tokens, state.tokens.stride(0), state.draft_len, state.draft_n, k, S, pool.page_size,
               COPY=speculation.lookup, BLOCK_S=block_s, BLOCK_K=triton.next_power_of_2(speculation.k))
    return k
