"""The engine's per-slot sequence state: fixed-size tensors on the engine's device.

Admission (blink.engine.core.admission) copies a request record into a FREE slot and marks it ADMITTED; everything
after that (scheduling, page bookkeeping, stop checks) is done by the step on the device. The driver reads a
slot's outputs and returns it to FREE once it is FINISHED.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from blink.shared.request_schema import FIELDS, MAX_LOGIT_BIAS, MAX_STOP_IDS
from blink.shared.speculative import MAX_LOOKUP, MAX_SPECULATIVE_TOKENS

# A new request's acceptance rate for its drafts, at every match length, before it has drafted: its first drafts run
# K deep where a draft token is cheap (a small batch) and two where it costs (docs/design.md, Decisions).
FIRST_RATE = 0.75


def none_set(*masks: torch.Tensor) -> bool:
    """Whether no element of these masks is set, said only where looking is free: eager on the CPU. Under
    torch.compile, and on a GPU (a sync there, and none may happen under capture), it says False: the work it guards
    runs and does nothing. The host mode's plan and commit skip so what an idle part of a step would do for nothing,
    a few microseconds of the CPU's dispatch for each of its ops."""
    if masks[0].device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return not any(bool(m.any()) for m in masks)


def pack(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices where mask is set, packed first (the rest 0), and how many there are."""
    n = mask.shape[0]
    rank = torch.where(mask, mask.cumsum(0) - 1, n)
    index = torch.arange(n, device=mask.device)
    return torch.zeros(n + 1, dtype=torch.int64, device=mask.device).scatter_(0, rank, index)[:n], mask.sum()


def host_bound(x: torch.Tensor, top: int) -> int:
    """A 0-d tensor's value, at most `top`, where reading it is free (eager on the CPU), to cut a search to what is
    live; `top` elsewhere (under torch.compile, and on a GPU: none_set's rule), where the work runs whole."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return top
    return min(int(x), top)


class SlotStatus(IntEnum):
    """A slot as the engine sees it; the slot table's words for the same moments (blink.shared.slot_table.SlotState:
    FREE, SUBMITTED, ADMITTED, FINISHED), with RUNNING once a step has planned it."""

    FREE = 0
    ADMITTED = 1  # its request is in the state; no step has planned it yet
    RUNNING = 2
    FINISHED = 3


class Slots:
    """The engine's slots: a tensor per field of every slot's sequence, on the engine's device (the slot table's
    SlotState is the state word of a record; these are the sequences behind them)."""

    # [S] each: the request schema's fields that have a state dtype (FIELDS' `state`), named as the field: what
    # admission copies a record into. Made from FIELDS in __init__; declared here for an editor (a test holds the two
    # equal, so a new field of FIELDS with a state dtype is a line here too).
    prompt_len: torch.Tensor  # int64
    max_tokens: torch.Tensor  # int64
    priority: torch.Tensor  # int64
    ignore_eos: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    min_p: torch.Tensor  # float32
    repetition_penalty: torch.Tensor  # float32
    presence_penalty: torch.Tensor  # float32
    frequency_penalty: torch.Tensor  # float32
    logprobs: torch.Tensor  # int64
    prompt_logprobs: torch.Tensor  # int64
    seed: torch.Tensor  # int64
    service_class: torch.Tensor  # int64
    min_tokens: torch.Tensor  # int64

    def __init__(self, num_slots: int, max_len: int, max_pages: int, vocab_size: int, device: torch.device):
        S = num_slots

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.num_slots, self.max_len = S, max_len
        self.status = zeros(S)
        for f in FIELDS:  # the declared schema tensors above
            if f.state is not None:
                setattr(self, f.name, torch.full((S,), f.default, dtype=getattr(torch, f.state), device=device))
        self.stop_ids = torch.full((S, MAX_STOP_IDS), -1, dtype=torch.int64, device=device)
        self.logit_bias_ids = torch.full((S, MAX_LOGIT_BIAS), -1, dtype=torch.int64, device=device)  # -1: none
        self.logit_bias = torch.zeros((S, MAX_LOGIT_BIAS), dtype=torch.float32, device=device)
        self.arrival = zeros(S)  # admission order; ties in priority go to the earlier arrival
        self.ttft_deadline = torch.full((S,), float("inf"), dtype=torch.float64, device=device)  # host clock, s
        self.tpot_slo = torch.full((S,), float("inf"), dtype=torch.float64, device=device)  # seconds
        self.cancel = zeros(S, dtype=torch.bool)
        self.paused = zeros(S, dtype=torch.bool)  # set while the reader's output window is full
        # Entries the reader's output window has room for (the driver's mirror of it, like `paused`): a request
        # that asks for its prompt's logprobs computes no more prompt tokens in a step than it can publish.
        self.room = torch.full((S,), max_len + 1, dtype=torch.int64, device=device)
        self.scored = zeros(S)  # prompt positions whose next token's logprob was published (prompt_logprobs)
        self.seq_len = zeros(S)  # prompt + generated tokens
        self.num_computed = zeros(S)  # tokens whose K/V are in the cache
        self.finish_reason = zeros(S)
        # Token history (prompt then output); the last column takes masked-off writes.
        self.tokens = zeros(S, max_len + 1, dtype=torch.int32)
        # Pages of each sequence; the last column takes masked-off writes.
        self.block_table = zeros(S, max_pages + 1)
        self.pages_held = zeros(S)
        # The prompt's page hashes, from the record: what prefix caching looks up and registers (prefix_cache).
        self.page_hashes = zeros(S, max_pages)
        # Sequences whose pages were rotated out to the host mirror wait there, in these pages, to come back.
        self.rotated = zeros(S, dtype=torch.bool)
        self.host_table = zeros(S, max_pages + 1)
        self.host_held = zeros(S)
        # What happened to each request, reported when it finishes.
        self.preemptions = zeros(S)
        self.pages_out = zeros(S)
        self.pages_in = zeros(S)
        self.cached_tokens = zeros(S)  # prompt tokens the prefix cache gave the request when it first started
        self.wait_s = zeros(S, dtype=torch.float64)
        self.output_counts = zeros(S, vocab_size, dtype=torch.int32)
        self.prompt_mask = zeros(S, vocab_size, dtype=torch.bool)
        self.num_preemptions = zeros()  # rotations out and recomputes, as vLLM counts swaps and recomputes
        self.num_recomputes = zeros()
        # Speculative decoding (engine/core/speculation.py): the drafts written after each sequence this step and the
        # length of the match they followed, each slot's decayed acceptance rate per match length (column n - 1; a
        # new request starts at FIRST_RATE), slots the host keeps from drafting (a grammar masks one row per
        # slot), and vLLM's counters: drafts, draft tokens, accepted tokens, and accepted tokens per draft position
        # (the last entry takes masked-off adds).
        self.draft_len = zeros(S)
        self.draft_n = zeros(S)
        self.spec_rate = torch.full((S, MAX_LOOKUP), FIRST_RATE, dtype=torch.float32, device=device)
        self.draft_off = zeros(S, dtype=torch.bool)
        self.spec_counts = zeros(3)
        self.spec_accepted_per_pos = zeros(MAX_SPECULATIVE_TOKENS + 1)

    def status_is(self, status: SlotStatus) -> torch.Tensor:
        """[S] whether each slot is in `status`. torch.eq, not ==: torch.compile traces `tensor == IntEnum` as a
        Python bool, and the step's bookkeeping must stay traceable (tests/engine/test_device_step.py)."""
        return self.status.eq(status)

    def release_slot(self, slot: int) -> None:
        """Host side: the slot's outputs have been read; it may take a new request."""
        self.status[slot] = SlotStatus.FREE
