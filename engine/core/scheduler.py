"""Admission and batch planning for one step, as fixed-shape tensor work on the engine's device.

plan() admits submitted slots, hands out the token budget (in the policy's order; decodes before prefill chunks),
makes room when pages run short (victims give their pages back: rotated out to the host mirror, or dropped for
recompute when the mirror is full or absent), brings rotated requests back when pages free, allocates pages and
lays the batch's tokens out flat. On a device it never reads a tensor back to the host (eager on the CPU, where a
read is free, it looks to skip parts with nothing to do: state.none_set); the only numbers the host must read are
the plan's sizes (`PlanSizes`), to pick the forward's buckets and to run the page copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import torch

from blink.engine.core.kv_cache import PagePool
from blink.engine.core.page_sharing import positions
from blink.engine.core.paging import find_pages
from blink.engine.core.policy import Policy, StepCost, lexsort
from blink.engine.core.prefix_cache import PrefixCache
from blink.engine.core.rotation import HostMirror, PageMoves
from blink.engine.core.state import FIRST_RATE, Slots, SlotStatus, none_set, pack

if TYPE_CHECKING:
    from blink.engine.core.speculation import Speculation

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
    sample_slot: torch.Tensor  # [S] slots that sample this step, packed first (with drafts: [rows], a row per
    # position of each speculating slot's run, in batch order)
    sample_token: torch.Tensor  # [S] batch index of each sampling row's last token (with drafts: its token)
    sample_valid: torch.Tensor  # [S]
    prompt_entries: torch.Tensor | None  # [S] prompt logprobs each slot publishes this step, ahead of its token;
    # None when the step may score none (no resident request asked)
    moves: PageMoves | None  # KV rotation's page copies, when the engine has a host mirror
    packed_sizes: torch.Tensor  # [7] int64 on the device: PlanSizes's fields in order, for one read by the host

    @property
    def sizes(self) -> PlanSizes[torch.Tensor]:
        """The sizes on the device, by name (0-d views: no sync): what the device step reads."""
        return PlanSizes(*self.packed_sizes.unbind())

    def read_sizes(self) -> PlanSizes[int]:
        """The host's one read of a plan (a sync): what it needs to pick the forward's buckets and copy pages."""
        return PlanSizes(*self.packed_sizes.tolist())


Size = TypeVar("Size", int, torch.Tensor)


class PlanSizes(NamedTuple, Generic[Size]):
    """What a plan leaves to its driver: ints once the host has read them, 0-d tensors on the device."""

    tokens: Size  # live tokens the step computes
    max_context: Size  # the longest context a sequence attends to
    decode_rows: Size  # sequences computing one token
    chunk_rows: Size  # blocks of sequences computing several (prefill chunks)
    pages_out: Size  # KV pages rotating to the host mirror
    pages_in: Size  # and back
    prompt_entries: Size  # prompt logprobs the step computes


@dataclass(frozen=True)
class PlanKernels:
    """Kernels that stand in for parts of the plan, each with its torch reference's arguments and effects (the
    device step's, engine/kernels/); None: the reference runs."""

    head: Callable | None = None  # _head
    reuse_prefix: Callable | None = None  # _reuse_prefix
    hand_out: Callable | None = None  # _hand_out
    make_room: Callable | None = None  # paging.make_room
    settle_take: Callable | None = None  # _settle_take
    lay_out: Callable[..., StepPlan] | None = None  # _lay_out


REFERENCE = PlanKernels()


def plan(state: Slots, pool: PagePool, token_budget: int, policy: Policy, mirror: HostMirror | None,
         cost: StepCost, prompt_rows: int, kernels: PlanKernels = REFERENCE,
         speculation: Speculation | None = None) -> StepPlan:
    """cost: the driver's step-time model; prompt_rows: the prompt logprobs one step may compute at most; kernels:
    the parts that run as kernels (the device step's); speculation: drafts for the decoding slots that may speculate
    (engine/core/speculation.py)."""
    running, resident, precedence, live, starting = (kernels.head or _head)(state, policy, mirror)
    if pool.prefix_cache is not None and not none_set(starting):
        (kernels.reuse_prefix or _reuse_prefix)(state, pool.prefix_cache, starting)
    take, entries, order, cap = (kernels.hand_out or _hand_out)(state, policy, cost, token_budget, prompt_rows, live)
    if speculation is not None:  # drafts take what budget and pages the plan leaves, before pages are found
        take = take + speculation.draft(state, pool, policy, cost, take, live, order, cap)
    take, moves, moved = find_pages(state, pool, policy, mirror, token_budget, take, running, resident, precedence,
                                   kernels.make_room)
    entries = (kernels.settle_take or _settle_take)(state, running, take, entries, cost, speculation is not None)
    drafts = ()
    if speculation is not None:
        drafts = (speculation.rows(state.num_slots, token_budget), speculation.decode_runs)
    return (kernels.lay_out or _lay_out)(state, take, entries, moves, moved, token_budget, *drafts)


def _head(state: Slots, policy: Policy, mirror: HostMirror | None):
    """The plan's start: ADMITTED slots start RUNNING. Returns the running slots, the resident ones (not rotated
    out), the policy's order alone (precedence: who keeps pages), the resident slots that may compute (live), and
    those of them starting first, which take what the prefix cache holds of their prompt (starting)."""
    running, resident = _start_admitted(state)
    precedence = lexsort(policy.keep_keys(state), first=torch.zeros_like(resident))
    fresh = resident & (state.num_computed == 0) & (state.pages_held == 0)
    held_back = fresh & _hold_new(state, policy, mirror, precedence)
    live = resident & ~state.paused & ~state.cancel & ~held_back
    return running, resident, precedence, live, fresh & ~held_back & ~state.cancel


def _start_admitted(state: Slots) -> tuple[torch.Tensor, torch.Tensor]:
    """ADMITTED slots start RUNNING. Returns the running slots and the resident ones (not rotated out)."""
    admitted = state.status_is(SlotStatus.ADMITTED)
    state.status.masked_fill_(admitted, SlotStatus.RUNNING)
    state.spec_rate.masked_fill_(admitted[:, None], FIRST_RATE)  # a new request's drafts, before any is settled
    running = state.status_is(SlotStatus.RUNNING)
    return running, running & ~state.rotated


def _hand_out(state: Slots, policy: Policy, cost: StepCost, token_budget: int, prompt_rows: int, live: torch.Tensor):
    """The token budget, in the policy's order up to its cap: (tokens per slot, prompt logprobs per slot or None,
    that order, the cap)."""
    demand = torch.where(live, state.seq_len - state.num_computed, 0)
    if prompt_rows:  # else no resident request asked for its prompt's logprobs
        # A request that does publishes one per prompt token it computes (and then its first token): no more than
        # its output window has room for.
        scoring = (state.prompt_logprobs >= 0) & (state.scored < state.prompt_len - 1)
        demand = torch.where(scoring, demand.minimum(state.room), demand)
    order = lexsort(policy.budget_keys(state, demand > 1), first=demand > 0)
    cap = policy.token_cap(state, demand == 1, cost, token_budget)
    wanted = demand[order]
    before = wanted.cumsum(0) - wanted
    take = torch.empty_like(demand).scatter_(0, order, (cap - before).clamp(min=0).minimum(wanted))
    take, entries = _score_prompts(state, take, order, prompt_rows) if prompt_rows else (take, None)
    return take, entries, order, cap


def _lay_out(state: Slots, take: torch.Tensor, entries: torch.Tensor | None, moves: PageMoves | None,
             moved: torch.Tensor, token_budget: int, draft_rows: int = 0, decode_runs: bool = False) -> StepPlan:
    """The batch's tokens flat, slot after slot; the query rows, the sampling rows and the sizes the driver reads.
    draft_rows: with drafts, the sampling rows' count (a row per token from each sampling slot's last committed one
    on); 0: a row per sampling slot. decode_runs: a slot's run with drafts is laid out as decode rows, one a token,
    for attention kernels that write every token's K/V before any row attends (the CPU's)."""
    S, device = state.num_slots, state.status.device
    ends = take.cumsum(0)
    starts = ends - take
    t = torch.arange(token_budget, device=device)
    token_slot = torch.searchsorted(ends, t, right=True).clamp(max=S - 1)
    token_valid = t < ends[-1]
    token_pos = torch.where(token_valid, state.num_computed[token_slot] + t - starts[token_slot], 0)
    input_ids = state.tokens[token_slot, token_pos].long()

    first_pos = state.num_computed
    if draft_rows and decode_runs:  # a run with drafts attends as decodes, a query a row (causal: each to its own)
        runs = (take > 0) & (take == 1 + state.draft_len)
        decode_token, num_decodes = pack(token_valid & runs[token_slot])
        decode_token = decode_token[:draft_rows]
        decode_rows = QueryRows(decode_token, torch.ones_like(decode_token), token_pos[decode_token],
                                token_slot[decode_token], num_decodes)
        chunk_rows = _chunk_rows(torch.where(runs, 0, take), starts, first_pos, token_budget)
    else:
        decode_slot, num_decodes = pack(take == 1)
        decode_rows = QueryRows(starts[decode_slot], take[decode_slot], first_pos[decode_slot], decode_slot,
                                num_decodes)
        chunk_rows = _chunk_rows(take, starts, first_pos, token_budget)
    samples = (take > 0) & (state.num_computed + take == state.seq_len + state.draft_len)
    if draft_rows:
        row_of = token_valid & samples[token_slot] & (token_pos >= state.seq_len[token_slot] - 1)
        sample_token, num_samples = pack(row_of)
        sample_token = sample_token[:draft_rows]
        sample_slot = token_slot[sample_token]
        sample_valid = torch.arange(draft_rows, device=device) < num_samples
    else:
        sample_slot, num_samples = pack(samples)
        sample_valid = torch.arange(S, device=device) < num_samples
        sample_token = torch.where(sample_valid, ends[sample_slot] - 1, 0)

    max_context = torch.where(token_valid, token_pos + 1, 0).amax()
    sizes = PlanSizes(tokens=ends[-1], max_context=max_context, decode_rows=num_decodes, chunk_rows=chunk_rows.count,
                      pages_out=moved[0], pages_in=moved[1],
                      prompt_entries=moved.new_zeros(()) if entries is None else entries.sum())
    return StepPlan(take, token_slot, token_pos, token_valid, input_ids, decode_rows, chunk_rows, sample_slot,
                    sample_token, sample_valid, entries, moves, torch.stack(sizes))


def _settle_take(state: Slots, running: torch.Tensor, take: torch.Tensor, entries: torch.Tensor | None, cost: StepCost,
                 drafts: bool) -> torch.Tensor | None:
    """What the plan settles once pages are found: a running slot that computes nothing this step waits it too, and
    one that lost its pages to a victim's need computes no prompt entries and (drafts: the step speculates) no
    drafts. Returns the entries."""
    state.wait_s += torch.where(running & ~state.paused & (take == 0), cost.since_last_plan, 0.0)
    if drafts:
        state.draft_len.masked_fill_(take == 0, 0)
    return None if entries is None else torch.where(take > 0, entries, 0)


def _reuse_prefix(state: Slots, cache: PrefixCache, starting: torch.Tensor) -> None:
    """Requests starting (or starting over after a recompute) take what the prefix cache holds of their prompt; one
    that asks for its prompt's logprobs computes every position."""
    starting = starting & (state.prompt_logprobs < 0)
    hit = cache.reuse(state.page_hashes, state.prompt_len, starting, state.block_table, state.pages_held,
                      state.num_computed)
    state.cached_tokens.copy_(torch.where(starting & (state.preemptions == 0), hit, state.cached_tokens))


def _score_prompts(state: Slots, take: torch.Tensor, order: torch.Tensor,
                   prompt_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt logprobs each slot computes with its tokens (its positions from `scored` up to the prompt's
    second last: each one's logits score the next prompt token), at most prompt_rows in all, handed out in the
    budget's order; a slot past that computes only as many tokens as it may score. Returns (take, entries)."""
    start = torch.maximum(state.num_computed, state.scored)
    asks = state.prompt_logprobs >= 0
    entries = torch.where(asks, (torch.minimum(state.num_computed + take, state.prompt_len - 1) - start).clamp(min=0),
                          0)
    wanted = entries[order]
    allowed = torch.empty_like(entries).scatter_(0, order, (prompt_rows - (wanted.cumsum(0) - wanted)).clamp(min=0))
    cut = entries > allowed
    # A cut slot computes up to its last allowed position (the positions it scored before are recomputed, if any).
    take = torch.where(cut, (start + allowed - state.num_computed).clamp(min=0), take)
    return take, torch.minimum(entries, allowed)


def max_chunk_rows(token_budget: int, num_slots: int) -> int:
    return token_budget // QUERY_BLOCK + num_slots


def _chunk_rows(take: torch.Tensor, starts: torch.Tensor, first_pos: torch.Tensor, token_budget: int) -> QueryRows:
    """Cuts every multi-token run into blocks of QUERY_BLOCK queries (the last one shorter)."""
    S = take.shape[0]
    per_slot = token_budget // QUERY_BLOCK + 1
    j = torch.arange(per_slot, device=take.device)
    blocks = torch.where(take > 1, (take + QUERY_BLOCK - 1) // QUERY_BLOCK, 0)
    index, count = pack((j[None, :] < blocks[:, None]).flatten())
    index = index[: max_chunk_rows(token_budget, S)]
    slot, offset = index // per_slot, index % per_slot * QUERY_BLOCK
    length = (take[slot] - offset).clamp(max=QUERY_BLOCK)
    return QueryRows(starts[slot] + offset, length, first_pos[slot] + offset, slot, count)


def _hold_new(state: Slots, policy: Policy, mirror: HostMirror | None, precedence: torch.Tensor) -> torch.Tensor:
    """Which requests may not start (all but the latency-sensitive, which may take pages by recompute at worst),
    while a rotated request waits to come back (pages they took would keep it out: it had starved behind a stream
    of later arrivals): all while the mirror is nearly full, else those the policy puts behind it. Rotated requests
    that wait for their readers hold nothing back: a reader that never reads would hold back every new request."""
    if mirror is None or none_set(state.rotated):
        return torch.zeros_like(state.rotated)
    waiting = state.rotated & state.status_is(SlotStatus.RUNNING) & ~state.cancel & ~state.paused
    rank = positions(precedence)
    behind = rank > torch.where(waiting, rank, state.num_slots).amin()
    return ((mirror.nearly_full() & waiting.any()) | behind) & ~policy.latency_sensitive(state)
