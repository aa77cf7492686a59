"""The end of a step: append sampled tokens, check stops and cancellation, release finished pages; and the prompt
logprobs the step scored, for the requests that asked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from blink.engine.core.kv_cache import PagePool
from blink.engine.core.paging import max_new_pages
from blink.engine.core.rotation import HostMirror
from blink.engine.core.sampler import TORCH_SAMPLER, SampleOutput, Sampler
from blink.engine.core.scheduler import StepPlan
from blink.engine.core.state import Slots, SlotStatus, none_set
from blink.shared.slot_table import Finish


@dataclass
class PromptScores:
    """The prompt tokens a step scored ([P] each, packed slot after slot; slot -1 past the real ones) and where
    each slot's run of them starts ([S]): published ahead of the slot's token, in this order."""

    slot: torch.Tensor
    token: torch.Tensor  # the prompt token scored
    logprob: torch.Tensor  # its logprob given the prompt before it
    top_ids: torch.Tensor  # [P, MAX_LOGPROBS]
    top_logprobs: torch.Tensor
    first: torch.Tensor  # [S] index of each slot's first row
    count: torch.Tensor  # [S] rows of each slot (the plan's prompt_entries)


def score_prompt(state: Slots, plan: StepPlan, batch_index: torch.Tensor, logits: torch.Tensor,
                 sampler: Sampler = TORCH_SAMPLER) -> PromptScores:
    """batch_index: [P] the batch tokens whose logits ([P, V] float32) score the prompt token after them."""
    slot, pos = plan.token_slot[batch_index], plan.token_pos[batch_index]
    count = plan.prompt_entries
    real = torch.arange(batch_index.shape[0], device=slot.device) < count.sum()
    token = state.tokens[slot, (pos + 1).clamp(max=state.max_len)].long()
    return PromptScores(torch.where(real, slot, -1), token, *sampler.logprobs(logits, token, real.long() - 1),
                        count.cumsum(0) - count, count)


@dataclass
class EmittedRuns:
    """The tokens each slot emitted in a step with drafts (engine/core/speculation.py), in order: [S, K + 1] each
    (the first `count[s]` real), the logprobs' [S, K + 1, ...] where the step computed them."""

    token: torch.Tensor
    count: torch.Tensor  # [S]
    logprob: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


@dataclass
class StepOutput:
    """What one step produced, per slot ([S] or [S, k]); `token` is -1 where a slot sampled nothing. With drafts,
    `runs` holds every token a slot emitted (token: the first), and the per-slot logprobs are in it alone."""

    token: torch.Tensor
    finish_reason: torch.Tensor  # Finish.NONE unless the slot finished this step
    logprob: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    row_slot: torch.Tensor  # [R] slot of each logits row
    row_logits: torch.Tensor  # [R, V] float32 logits the rows sampled from, before penalties
    prompt: PromptScores | None = None  # when a resident request asked for its prompt's logprobs
    runs: EmittedRuns | None = None  # with speculative decoding: one to K + 1 tokens per slot


def commit(state: Slots, pool: PagePool, mirror: HostMirror | None, plan: StepPlan, rows: int, out: SampleOutput,
           logits: torch.Tensor, eos_ids: torch.Tensor, count_outputs: bool,
           prompt: PromptScores | None = None, settler: Callable[..., StepOutput] | None = None,
           advancer: Callable[..., torch.Tensor] | None = None) -> StepOutput:
    """settler, advancer: `settle`, `advance` or kernels of the same arguments and effects
    (blink.engine.kernels.commit, the device step's)."""
    before = (advancer or advance)(state, plan)
    if pool.prefix_cache is not None and not none_set(before < state.prompt_len):
        # The prompt pages this step filled can be found from now on.
        pool.prefix_cache.register(state.page_hashes, state.prompt_len, before, state.num_computed, state.block_table,
                                   max_new_pages(plan.token_slot.shape[0], pool.page_size))
    settled = (settler or settle)(state, plan, rows, out, logits, eos_ids, count_outputs)
    finished = settled.finish_reason.ne(Finish.NONE)  # ne, eq: see Slots.status_is
    if not none_set(finished):
        pool.release(finished, state.block_table, state.pages_held)
        if mirror:  # a request cancelled while rotated out
            mirror.free.release(finished, state.host_table, state.host_held)
            state.rotated &= ~finished
    settled.prompt = prompt
    return settled


def advance(state: Slots, planned: StepPlan) -> torch.Tensor:
    """What a step computed as planned: tokens whose K/V are now cached, prompt positions now scored. Returns the
    tokens each slot had computed before the step."""
    if planned.prompt_entries is not None:
        state.scored.copy_(torch.where(planned.prompt_entries > 0,
                                       torch.maximum(state.num_computed, state.scored) + planned.prompt_entries,
                                       state.scored))
    state.num_computed += planned.take
    return state.num_computed - planned.take


def settle(state: Slots, plan: StepPlan, rows: int, out: SampleOutput, logits: torch.Tensor, eos_ids: torch.Tensor,
           count_outputs: bool) -> StepOutput:
    """The sampled tokens appended (and counted for the penalties), stops and cancellations checked, finished slots
    marked FINISHED with their reason, the rows' outputs per slot; pages are commit's."""
    S = state.num_slots
    slot, sampled = plan.sample_slot[:rows], plan.sample_valid[:rows]
    # max_tokens 0 (the prompt's logprobs only): the row ends its request without a token.
    valid = sampled & (state.max_tokens[slot] > 0)
    # Invalid rows are routed to index S (a trash entry) or to the tokens' trash column.
    target = torch.where(valid, slot, S)
    tok = out.tokens
    state.tokens[slot, torch.where(valid, state.seq_len[slot], state.max_len)] = tok.int()
    state.seq_len.index_add_(0, slot, valid.long())
    if count_outputs:
        state.output_counts.index_put_((slot, tok), valid.int(), accumulate=True)

    stopped, too_long = ends_request(state, slot, tok, eos_ids, state.seq_len[slot])
    row_reason = torch.where(stopped & valid, Finish.STOP, torch.where(too_long, Finish.LENGTH, 0))
    reason = per_slot(S, torch.where(sampled, slot, S), row_reason, 0)
    running = state.status_is(SlotStatus.RUNNING)
    reason = torch.where(running & state.cancel & (reason == 0), Finish.ABORT, reason)

    finished = reason.ne(Finish.NONE)
    state.finish_reason.copy_(torch.where(finished, reason, state.finish_reason))
    state.status.masked_fill_(finished, SlotStatus.FINISHED)

    def slot_values(x: torch.Tensor | None, fill: float) -> torch.Tensor | None:
        return None if x is None else per_slot(S, target, x, fill)

    return StepOutput(
        token=torch.where(reason.eq(Finish.ABORT), -1, per_slot(S, target, tok, -1)),  # aborts emit nothing
        finish_reason=reason,
        logprob=slot_values(out.logprob, 0.0),
        top_ids=slot_values(out.top_ids, -1),
        top_logprobs=slot_values(out.top_logprobs, 0.0),
        row_slot=torch.where(valid, slot, -1),
        row_logits=logits,
    )


def ends_request(state: Slots, slot: torch.Tensor, tok: torch.Tensor, eos_ids: torch.Tensor,
                 seq_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R] whether each row's token stops its request (a stop id, or eos unless ignored), and whether the request is
    at its length limit (max_tokens, or the context) once its sequence is `seq_len` long with that token."""
    stopped = (state.stop_ids[slot] == tok[:, None]).any(-1)
    # Not torch.isin: on CUDA past a few ids it sorts, and syncs (which no captured step may).
    stopped |= (tok[:, None] == eos_ids).any(-1) & ~state.ignore_eos[slot]
    too_long = (seq_len - state.prompt_len[slot] >= state.max_tokens[slot]) | (seq_len >= state.max_len)
    return stopped, too_long


def per_slot(num_slots: int, target: torch.Tensor, rows: torch.Tensor, fill: float) -> torch.Tensor:
    """Scatters [R, ...] row values to [S, ...] slot values; target S is the trash entry."""
    full = torch.full((num_slots + 1, *rows.shape[1:]), fill, dtype=rows.dtype, device=rows.device)
    full[target] = rows
    return full[:num_slots]
