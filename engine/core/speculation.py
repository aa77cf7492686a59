"""Speculative decoding inside the step (`--speculative-config`, methods ngram and draft_model): drafts proposed,
verified and accepted as tensor work on the engine's device, with no host read.

- `Speculation.draft` (in the plan, after the token budget is handed out): for each decoding slot allowed to
  speculate, the latest earlier occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
  in its own prompt and output; up to K tokens that followed it are the draft, written after the sequence
  (`state.tokens[s, seq_len:seq_len + k]`, uncommitted) with `state.draft_len[s] = k`. With a draft model
  (`lookup` off) only k is planned here; engine/core/draft_model.py writes the tokens in the step. The slot then
  computes 1 + k tokens in the step, a multi-token run like a prefill chunk, and each of them is a sampling row.
- `Speculation.settle` (the commit's settler): each row sampled as plain decoding would have for that position (its
  step_index is the position's), so the accepted run is the longest prefix of drafts equal to the target's own
  draws, and the tokens emitted are the rows' up to and including the first that differs (its correction, or the
  bonus token after K accepted). Greedy rows give plain decoding's tokens; sampled rows keep plain decoding's
  distribution and seeded draws (docs/design.md, Decisions). Stops, eos, max_tokens and the context limit end a run
  at the token that meets them; `num_computed` is taken back to the KV that is valid.
- Policy: a slot speculates while its decayed acceptance rate for drafts after a match of the length it found (a
  rate per length: a 1-token match's drafts fail more often than a 4-token one's; the chance a draft token is kept
  once the ones before it were) is above what a draft token costs by the step-cost fit, its kind's drafts counted
  (the latency-sensitive slots' TPOT, the batch's throughput for best-effort ones), and as deep as the rate raised
  to the position still pays; with a slow climb back so a slot that stopped retries; drafts take only the token
  budget and free pages left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from blink.engine.core.commit import EmittedRuns, StepOutput, ends_request, per_slot
from blink.engine.core.kv_cache import PagePool
from blink.engine.core.policy import Policy, StepCost
from blink.engine.core.sampler import SampleOutput
from blink.engine.core.state import Slots, SlotStatus, host_bound, none_set
from blink.engine.model.config import ModelConfig
from blink.shared.slot_table import Finish
from blink.shared.speculative import SpeculativeConfig

DECAY = 0.5  # weight of the past in a slot's acceptance rate: two bad drafts halve it twice
RETRY = 0.01  # what a slot not drafting regains of its rate each step, so it tries again after a while
MIN_RATE = 0.15  # below this acceptance a draft is not tried whatever the fit says (the fit is noisy)


@dataclass(frozen=True)
class Speculation:
    k: int  # num_speculative_tokens
    lookup_min: int
    lookup_max: int
    # Drafts looked up in the request's own tokens (ngram); False: a draft model writes them in the step
    # (engine/core/draft_model.py), so any slot that may draft has K to offer, under one rate (column 0).
    lookup: bool = True
    # Runs with drafts attend as decode rows, one a query: where the attention kernel writes every token's K/V
    # before any row reads (the CPU's decode kernel, 10x cheaper a layer than its prefill path for a short run,
    # and the one plain decoding's tokens come from); else as a prefill chunk.
    decode_runs: bool = False
    # What a draft's logits row costs besides its token's forward, as a share of that forward (the step-cost fit's
    # per-token cost is the layers' alone: prefill tokens compute no logits): the output embedding over the layers.
    row_share: float = 0.0
    # A draft model's forward as a share of the target's (0 with lookup: DraftModel.cost_ratio).
    draft_ratio: float = 0.0
    # settle's and draft's kernels, taking the speculation first (a kernel set's, bound by Step.use: the device step's
    # Triton, engine/kernels/commit.py and draft.py; the CPU's C++, cpu_commit.py and cpu_draft.py); None: the torch
    # references below.
    settle_kernel: Callable | None = field(default=None, compare=False)
    draft_kernel: Callable | None = field(default=None, compare=False)

    @classmethod
    def of(cls, config: SpeculativeConfig, model: ModelConfig | None = None, decode_runs: bool = False,
           draft_ratio: float = 0.0) -> Speculation:
        """draft_ratio: a draft model's forward as a share of the model's (DraftModel.cost_ratio), when one drafts."""
        share = 0.0 if model is None else model.vocab_size * model.hidden_size / _layers_weights(model)
        if config.model is None:
            return cls(config.num_speculative_tokens, config.lookup_min, config.lookup_max, decode_runs=decode_runs,
                       row_share=share)
        return cls(config.num_speculative_tokens, 1, 1, lookup=False, decode_runs=decode_runs, row_share=share,
                   draft_ratio=draft_ratio)

    @property
    def token_share(self) -> float:
        """A draft token's cost beyond a token's forward, in units of it, plus one: its logits row, and with a draft
        model the draft's forward of it and its shadow row (DraftModel.propose)."""
        return 1 + self.row_share + 2 * self.draft_ratio

    def rows(self, num_slots: int, tokens: int) -> int:
        """Sampling rows a step of `tokens` batch tokens may have: 1 + k per slot at most, one per token."""
        return min(num_slots * (1 + self.k), tokens)

    def draft(self, state: Slots, pool: PagePool, policy: Policy, cost: StepCost, take: torch.Tensor,
              live: torch.Tensor, order: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        """[S] draft tokens each slot computes on top of `take` (written into state.tokens); order: the budget's,
        cap: the most tokens the step may run."""
        if self.draft_kernel is not None and not torch.compiler.is_compiling():
            return self.draft_kernel(self, state, pool, policy, cost, take, live, order, cap)
        seq = state.seq_len
        state.draft_len.zero_()
        decoding = live & (take == 1) & (seq - state.num_computed == 1) & (state.max_tokens > 0)
        penalised = (state.repetition_penalty != 1) | (state.presence_penalty != 0) | (state.frequency_penalty != 0)
        scoring = (state.prompt_logprobs >= 0) & (state.scored < state.prompt_len - 1)
        able = decoding & ~penalised & ~scoring & ~state.draft_off
        if none_set(able):
            return torch.zeros_like(take)
        start, found, n = self.propose(state, able)
        # The slot's rate for drafts after a match of this length: a short match's drafts fail more often.
        column = (n - 1).clamp(min=0)[:, None]
        rate = state.spec_rate.gather(1, column)[:, 0]
        matched = able & (n > 0)
        need = self.threshold(state, policy, cost, take, able)
        wants = matched & (rate >= need)
        state.spec_rate.scatter_(1, column, torch.where(matched & ~wants, rate + RETRY * (1 - rate), rate)[:, None])
        generated = seq - state.prompt_len
        k = torch.minimum(found, state.max_tokens - generated - 1).minimum(state.max_len - seq - 1)
        # As deep as a draft token pays: the j-th is kept only if the j - 1 before it were, about rate**j of the time,
        # and costs `need` (a slot whose rate is just above it drafts one token, not K).
        depth, kept = torch.ones_like(k), rate * rate  # float32 products in turn (the kernels' own)
        for _ in range(self.k - 1):
            depth += kept >= need
            kept = kept * rate
        k = torch.where(wants, k.minimum(state.room - 1).minimum(depth), 0).clamp(min=0, max=self.k)
        k = self._fit(state, pool, take, k, order, cap)
        state.draft_n.copy_(torch.where(k > 0, n, 0))
        state.draft_len.copy_(k)
        if not self.lookup:
            return k
        i = torch.arange(self.k, device=seq.device)
        src = (start[:, None] + i).clamp(max=state.max_len)
        dst = torch.where(i < k[:, None], seq[:, None] + i, state.max_len)  # the trash column past the drafts
        state.tokens.scatter_(1, dst, state.tokens.gather(1, src))
        return k

    def threshold(self, state: Slots, policy: Policy, cost: StepCost, take: torch.Tensor,
                  able: torch.Tensor) -> torch.Tensor:
        """[S] the acceptance rate a slot's drafts must have to pay, by the step-cost fit (a + b * tokens): k draft
        tokens cost b * k for the whole step and bring rate * k tokens. When the N slots of a kind all draft, each one's
        TPOT gains while rate > b * N / (a + b * T) (b with token_share; a draft model adds its forward a draft token,
        draft_ratio * a, however many slots draft). Latency-sensitive slots count only their own kind (their drafts
        come first in the budget); best-effort ones every slot sampling, whose worth is the batch's tokens per
        second: a full batch keeps them from drafting, and a large latency-sensitive one too."""
        tokens = take.sum().double()
        sampling = ((take > 0) & (state.num_computed + take == state.seq_len)).sum().double()
        sensitive = policy.latency_sensitive(state)
        step = cost.per_step + cost.per_token * tokens
        per_draft = torch.where(step > 0, cost.per_token * self.token_share / step.clamp(min=1e-12), 0.0)
        # A draft model's forward a draft token, whatever the rows: its fixed cost, shared by the drafting slots.
        forward = torch.where(step > 0, cost.per_step * self.draft_ratio / step.clamp(min=1e-12), 0.0)
        need = per_draft * torch.where(sensitive, (able & sensitive).sum().double(), sampling).clamp(min=1) + forward
        return need.float().clamp(min=MIN_RATE)

    def propose(self, state: Slots, able: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([S] where each slot's draft starts in its tokens, [S] its length, [S] the n of its match; 0 for none):
        after the latest earlier occurrence of the sequence's last n tokens, the longest n in [lookup_min,
        lookup_max] that has one. Only the history the able slots have is searched, where the host knows its length
        for free. Without lookup (a draft model's), every able slot: K tokens, a 1-token "match"."""
        tokens, seq = state.tokens, state.seq_len
        if not self.lookup:
            return torch.zeros_like(seq), torch.where(able, self.k, 0), able.long()
        # The trash column is no history; one column at least, should the skip before (none_set) not have looked.
        W = max(host_bound(torch.where(able, seq, 0).amax(), tokens.shape[1] - 1), 1)
        history = tokens[:, :W]
        j = torch.arange(W, device=seq.device)  # where a match ends (its last token)
        matched = j[None, :] < (seq - 1)[:, None]  # an earlier occurrence ends before the last token
        start = torch.zeros_like(seq)
        found = torch.zeros_like(seq)
        length = torch.zeros_like(seq)
        for n in range(1, self.lookup_max + 1):  # matched: the last n tokens end at j too
            d = n - 1
            last = tokens.gather(1, (seq - 1 - d).clamp(min=0)[:, None])
            matched[:, d:] &= history[:, : max(W - d, 0)] == last
            matched[:, :d].fill_(False)  # no whole occurrence ends there
            if n < self.lookup_min:
                continue
            latest = torch.where(matched, j, -1).amax(1)
            longer = (latest >= 0) & (seq >= n)  # n counts up: a longer match replaces a shorter one
            start = torch.where(longer, latest + 1, start)
            found = torch.where(longer, (seq - latest - 1).clamp(max=self.k), found)
            length = torch.where(longer, n, length)
        return start, found, length

    def _fit(self, state: Slots, pool: PagePool, take: torch.Tensor, k: torch.Tensor, order: torch.Tensor,
             cap: torch.Tensor) -> torch.Tensor:
        """The drafts cut to the budget the plan left (in its order) and to the free pages the plan leaves: a
        draft never takes a token or a page another slot's tokens would have had."""
        wanted = k[order]
        before = wanted.cumsum(0) - wanted
        left = cap - take.sum()
        k = torch.empty_like(k).scatter_(0, order, (left - before).clamp(min=0).minimum(wanted))
        page = pool.page_size
        ends = state.num_computed + take
        held = torch.maximum(state.pages_held, (ends + page - 1) // page)
        base = torch.where(take > 0, held - state.pages_held, 0).sum()
        extra = ((ends + k + page - 1) // page - held).clamp(min=0)
        extra_o = extra[order]
        fits_o = extra_o.cumsum(0) + base <= pool.num_free
        fits = torch.empty_like(fits_o).scatter_(0, order, fits_o)
        return torch.where(fits, k, 0)

    def settle(self, state: Slots, plan, rows: int, out: SampleOutput, logits: torch.Tensor, eos_ids: torch.Tensor,
               count_outputs: bool) -> StepOutput:
        """commit.settle for steps with drafts: each slot's rows, in position order, accepted up to the first whose
        token differs from the draft after it; emitted up to the first that ends the request."""
        if self.settle_kernel is not None and not torch.compiler.is_compiling():
            return self.settle_kernel(self, state, plan, rows, out, logits, eos_ids, count_outputs)
        S, K = state.num_slots, self.k
        slot, sampled = plan.sample_slot[:rows], plan.sample_valid[:rows]
        seq = state.seq_len[slot]
        i = torch.where(sampled, plan.token_pos[plan.sample_token[:rows]] - (seq - 1), 0)  # offset in the run
        k = state.draft_len[slot]
        tok = out.tokens
        r = torch.arange(rows, device=tok.device)
        first = (r - i).clamp(min=0)  # the slot's first row (runs are consecutive rows)

        def earlier(flag: torch.Tensor) -> torch.Tensor:
            """Whether a row before this one in its slot's run has `flag`."""
            c = flag.long().cumsum(0) - flag.long()
            return c > c[first]

        draft_next = state.tokens[slot, (seq + i).clamp(max=state.max_len)].long()
        breaks = sampled & ((i >= k) | (tok != draft_next))  # its token is the correction, or the bonus one
        stopped, too_long = ends_request(state, slot, tok, eos_ids, seq + i + 1)
        live = sampled & ~earlier(breaks) & ~earlier(too_long | stopped)
        valid = live & (state.max_tokens[slot] > 0)
        state.tokens[slot, torch.where(valid, seq + i, state.max_len)] = tok.int()
        emitted = torch.zeros(S + 1, dtype=torch.int64, device=tok.device).index_add_(
            0, torch.where(valid, slot, S), valid.long())[:S]
        if count_outputs:
            state.output_counts.index_put_((slot, tok), valid.int(), accumulate=True)
        accepted_row = sampled & (i < k) & ~breaks & ~earlier(breaks)
        self._count(state, slot, i, accepted_row, S)

        row_reason = torch.where(stopped & valid, Finish.STOP, torch.where(too_long & live, Finish.LENGTH, 0))
        reason = torch.zeros(S + 1, dtype=torch.int64, device=tok.device).scatter_reduce(
            0, torch.where(live, slot, S), row_reason, "amax")[:S]
        running = state.status_is(SlotStatus.RUNNING)
        reason = torch.where(running & state.cancel & (reason == 0), Finish.ABORT, reason)
        drafted = state.draft_len > 0
        # Valid KV: the last committed token and the accepted drafts; the rest is overwritten when recomputed.
        state.num_computed.sub_(torch.where(drafted, state.draft_len + 1 - emitted, 0).clamp(min=0))
        state.seq_len.add_(emitted)
        state.draft_len.zero_()
        finished = reason.ne(Finish.NONE)
        state.finish_reason.copy_(torch.where(finished, reason, state.finish_reason))
        state.status.masked_fill_(finished, SlotStatus.FINISHED)

        aborted = reason.eq(Finish.ABORT)
        count = torch.where(aborted, 0, emitted)  # aborts emit nothing
        at = torch.where(valid & (i <= K), slot * (K + 1) + i, S * (K + 1))  # [S * (K + 1)] flat, then trash

        def runs(x: torch.Tensor | None, fill: float) -> torch.Tensor | None:
            return None if x is None else per_slot(S * (K + 1), at, x, fill).view(S, K + 1, *x.shape[1:])

        tokens = runs(tok, -1)
        return StepOutput(
            token=torch.where(count > 0, tokens[:, 0], -1),
            finish_reason=reason,
            logprob=None, top_ids=None, top_logprobs=None,
            row_slot=torch.where(valid, slot, -1),
            row_logits=logits,
            runs=EmittedRuns(tokens, count, runs(out.logprob, 0.0), runs(out.top_ids, -1),
                             runs(out.top_logprobs, 0.0)),
        )

    def _count(self, state: Slots, slot: torch.Tensor, i: torch.Tensor, accepted: torch.Tensor, S: int) -> None:
        """vLLM's counters (drafts, draft tokens, accepted tokens, accepted per position) and each slot's rate."""
        k = state.draft_len
        drafted = k > 0
        a = torch.zeros(S + 1, dtype=torch.int64, device=k.device).index_add_(
            0, torch.where(accepted, slot, S), accepted.long())[:S]
        state.spec_counts[0] += drafted.sum()
        state.spec_counts[1] += k.sum()
        state.spec_counts[2] += a.sum()
        state.spec_accepted_per_pos.index_add_(0, torch.where(accepted, i, state.spec_accepted_per_pos.shape[0] - 1)
                                               .clamp(max=state.spec_accepted_per_pos.shape[0] - 1), accepted.long())
        column = (state.draft_n - 1).clamp(min=0)[:, None]  # the rate of the match length the drafts followed
        old = state.spec_rate.gather(1, column)[:, 0]
        # A draft token's chance to be kept once the ones before it were: a accepted of the a + 1 tried (all k if
        # none failed), what `draft`'s depth raises to the power of the position.
        rate = DECAY * old + (1 - DECAY) * a.float() / torch.minimum(a + 1, k).clamp(min=1).float()
        state.spec_rate.scatter_(1, column, torch.where(drafted, rate, old)[:, None])


def _layers_weights(model: ModelConfig) -> int:
    """The weights a token's forward reads in the layers (a MoE's: the experts it runs)."""
    attention = model.hidden_size * (2 * model.q_size + 2 * model.kv_size)
    mlp = 3 * model.hidden_size * model.intermediate_size
    if model.moe is not None:
        mlp = 3 * model.hidden_size * model.moe.intermediate_size * model.moe.top_k
    return model.num_layers * (attention + mlp)
