"""Admission and batch planning for one step, as fixed-shape tensor work on the engine's device.

plan() admits submitted slots, hands out the token budget (decodes first, then prefill chunks, each
group by priority then arrival), preempts by recompute when pages run out (lowest priority, then
latest arrival, first), allocates pages and lays the batch's tokens out flat. It never reads a tensor
back to the host; the only numbers the host may read are `sizes`, to pick the forward's buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blink.engine.kv_cache import PagePool
from blink.engine.state import SlotState, SlotStatus

_NOT_CANDIDATE = 1 << 62
QUERY_BLOCK = 64  # prefill chunks are attended in blocks of this many queries


@dataclass
class QueryRows:
    """Runs of consecutive batch tokens of one sequence, packed first; the first `count` are real."""

    start: torch.Tensor  # [N] batch index of the run's first token
    length: torch.Tensor  # [N]
    first_pos: torch.Tensor  # [N] sequence position of the run's first token
    slot: torch.Tensor  # [N]
    count: torch.Tensor  # scalar

    def head(self, n: int) -> QueryRows:
        return QueryRows(self.start[:n], self.length[:n], self.first_pos[:n], self.slot[:n], self.count)


@dataclass
class StepPlan:
    take: torch.Tensor  # [S] tokens each slot computes this step
    token_slot: torch.Tensor  # [T] slot of each batch token
    token_pos: torch.Tensor  # [T] position of each batch token in its sequence
    token_valid: torch.Tensor  # [T] False for padding past num_tokens
    input_ids: torch.Tensor  # [T]
    decode_rows: QueryRows  # sequences computing one token
    chunk_rows: QueryRows  # sequences computing several (prefill chunks), in blocks of QUERY_BLOCK
    sample_slot: torch.Tensor  # [S] slots that sample this step, packed first
    sample_token: torch.Tensor  # [S] batch index of each sampling row's last token
    sample_valid: torch.Tensor  # [S]
    sizes: torch.Tensor  # [4]: tokens, longest context, decode rows, chunk rows


def _precedence(state: SlotState) -> torch.Tensor:
    """Lower is served first: priority (vLLM: lower runs first), then arrival."""
    return ((state.priority + (1 << 15)) << 32) + state.arrival


def plan(state: SlotState, pool: PagePool, token_budget: int, track_prompts: bool) -> StepPlan:
    S = state.num_slots
    device = state.status.device
    page = pool.page_size

    # Admit.
    admitted = state.status == SlotStatus.SUBMITTED
    state.status.masked_fill_(admitted, SlotStatus.RUNNING)
    if track_prompts:
        _track_prompt_tokens(state, admitted)
    running = state.status == SlotStatus.RUNNING

    # Hand out the token budget: decodes first, then prefill chunks.
    demand = torch.where(running & ~state.paused & ~state.cancel, state.seq_len - state.num_computed, 0)
    precedence = _precedence(state)
    prefill = (demand > 1).long()
    key = torch.where(running & (demand > 0), (prefill << 48) + precedence, _NOT_CANDIDATE)
    order = key.argsort()
    wanted = demand[order]
    before = wanted.cumsum(0) - wanted
    take = torch.empty_like(demand).scatter_(0, order, (token_budget - before).clamp(min=0).minimum(wanted))

    # Pages, preempting by recompute when they run out.
    covered = (state.num_computed + take + page - 1) // page
    need = torch.where(take > 0, covered - state.pages_held, 0).clamp(min=0)
    need, take, evicted = _preempt(state, pool, need, take, running, precedence)
    pool.release(evicted, state.block_table, state.pages_held)
    state.num_computed.masked_fill_(evicted, 0)
    state.num_preemptions += evicted.sum()
    pool.allocate(need, state.block_table, state.pages_held, max_new=token_budget // page + 2)

    # Lay the batch out flat, slot after slot.
    ends = take.cumsum(0)
    starts = ends - take
    t = torch.arange(token_budget, device=device)
    token_slot = torch.searchsorted(ends, t, right=True).clamp(max=S - 1)
    token_valid = t < ends[-1]
    token_pos = torch.where(token_valid, state.num_computed[token_slot] + t - starts[token_slot], 0)
    input_ids = state.tokens[token_slot, token_pos].long()

    first_pos = state.num_computed
    decode_slot, num_decodes = _pack(take == 1)
    decode_rows = QueryRows(starts[decode_slot], take[decode_slot], first_pos[decode_slot], decode_slot, num_decodes)
    chunk_rows = _chunk_rows(take, starts, first_pos, token_budget)
    sample_slot, num_samples = _pack((take > 0) & (state.num_computed + take == state.seq_len))
    sample_valid = torch.arange(S, device=device) < num_samples
    sample_token = torch.where(sample_valid, ends[sample_slot] - 1, 0)

    max_context = torch.where(token_valid, token_pos + 1, 0).amax()
    sizes = torch.stack([ends[-1], max_context, num_decodes, chunk_rows.count])
    return StepPlan(take, token_slot, token_pos, token_valid, input_ids, decode_rows, chunk_rows, sample_slot,
                    sample_token, sample_valid, sizes)


def max_chunk_rows(token_budget: int, num_slots: int) -> int:
    return token_budget // QUERY_BLOCK + num_slots


def _chunk_rows(take: torch.Tensor, starts: torch.Tensor, first_pos: torch.Tensor, token_budget: int) -> QueryRows:
    """Cuts every multi-token run into blocks of QUERY_BLOCK queries (the last one shorter)."""
    S = take.shape[0]
    per_slot = token_budget // QUERY_BLOCK + 1
    j = torch.arange(per_slot, device=take.device)
    blocks = torch.where(take > 1, (take + QUERY_BLOCK - 1) // QUERY_BLOCK, 0)
    index, count = _pack((j[None, :] < blocks[:, None]).flatten())
    index = index[: max_chunk_rows(token_budget, S)]
    slot, offset = index // per_slot, index % per_slot * QUERY_BLOCK
    length = (take[slot] - offset).clamp(max=QUERY_BLOCK)
    return QueryRows(starts[slot] + offset, length, first_pos[slot] + offset, slot, count)


def _pack(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices where mask is set, packed first (the rest 0), and how many there are."""
    n = mask.shape[0]
    rank = torch.where(mask, mask.cumsum(0) - 1, n)
    index = torch.arange(n, device=mask.device)
    return torch.zeros(n + 1, dtype=torch.int64, device=mask.device).scatter_(0, rank, index)[:n], mask.sum()


def _preempt(state: SlotState, pool: PagePool, need: torch.Tensor, take: torch.Tensor,
             running: torch.Tensor, precedence: torch.Tensor):
    """Keeps the longest prefix of slots, in precedence order, whose new pages fit once every slot after
    it gives its pages back; then evicts from the back only as many holders as that prefix needs."""
    order = torch.where(running, precedence, _NOT_CANDIDATE).argsort()
    need_o, held_o = need[order], state.pages_held[order]
    held_after = held_o.sum() - held_o.cumsum(0)
    fits_o = need_o.cumsum(0) <= pool.num_free + held_after
    deficit = (need_o * fits_o).sum() - pool.num_free
    evict_o = ~fits_o & (held_o > 0) & (held_after < deficit)
    fits = torch.empty_like(fits_o).scatter_(0, order, fits_o)
    evicted = torch.empty_like(evict_o).scatter_(0, order, evict_o)
    # A slot past the prefix still runs if it needs no new page and keeps its own.
    runs = fits | ((need == 0) & ~evicted)
    return torch.where(fits, need, 0), torch.where(runs, take, 0), evicted


def _track_prompt_tokens(state: SlotState, admitted: torch.Tensor) -> None:
    """For penalties: which vocab ids each newly admitted prompt holds; output counts start at zero."""
    cols = torch.arange(state.max_len, device=admitted.device)
    in_prompt = (admitted[:, None] & (cols[None, :] < state.prompt_len[:, None])).int()
    counts = torch.zeros_like(state.output_counts).scatter_add_(1, state.tokens[:, :-1].long(), in_prompt)
    state.prompt_mask.copy_(torch.where(admitted[:, None], counts > 0, state.prompt_mask))
    state.output_counts.masked_fill_(admitted[:, None], 0)
