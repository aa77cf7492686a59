"""The engine's per-slot sequence state: fixed-size tensors on the engine's device.

The host writes a request into an EMPTY slot and marks it SUBMITTED; everything after that (admission,
scheduling, page bookkeeping, stop checks) is done by the step on the device. The host reads a slot's
outputs and returns it to EMPTY once it is FINISHED.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from blink.engine.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from blink.shared.slot_table import Finish as FinishReason  # one set of codes, engine and slot table


class SlotStatus(IntEnum):
    EMPTY = 0
    SUBMITTED = 1
    RUNNING = 2
    FINISHED = 3




@dataclass
class SlotRequest:
    """What the host writes into a slot: one tokenized, validated request."""

    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # drawn by the host when the request gives none
    arrival: int  # submission order; ties in priority go to the earlier arrival
    max_tokens: int  # already capped by the context limit
    ttft_deadline: float = float("inf")  # absolute, seconds on the host's monotonic clock


class SlotState:
    def __init__(self, num_slots: int, max_len: int, max_pages: int, vocab_size: int, device: torch.device):
        S = num_slots

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.num_slots, self.max_len = S, max_len
        self.status = zeros(S)
        self.arrival = zeros(S)
        self.priority = zeros(S)
        self.service_class = zeros(S)  # blink.shared.service_class.ServiceClass
        self.ttft_deadline = torch.full((S,), float("inf"), dtype=torch.float64, device=device)
        self.tpot_slo = torch.full((S,), float("inf"), dtype=torch.float64, device=device)  # seconds
        self.cancel = zeros(S, dtype=torch.bool)
        self.paused = zeros(S, dtype=torch.bool)  # set while the reader's output window is full
        self.prompt_len = zeros(S)
        self.seq_len = zeros(S)  # prompt + generated tokens
        self.num_computed = zeros(S)  # tokens whose K/V are in the cache
        self.max_tokens = zeros(S)
        self.ignore_eos = zeros(S, dtype=torch.bool)
        self.stop_ids = torch.full((S, MAX_STOP_TOKEN_IDS), -1, dtype=torch.int64, device=device)
        self.temperature = zeros(S, dtype=torch.float32)
        self.top_p = zeros(S, dtype=torch.float32)
        self.top_k = zeros(S)
        self.min_p = zeros(S, dtype=torch.float32)
        self.repetition_penalty = zeros(S, dtype=torch.float32)
        self.presence_penalty = zeros(S, dtype=torch.float32)
        self.frequency_penalty = zeros(S, dtype=torch.float32)
        self.seed = zeros(S)
        self.finish_reason = zeros(S)
        # Token history (prompt then output); the last column takes masked-off writes.
        self.tokens = zeros(S, max_len + 1, dtype=torch.int32)
        # Pages of each sequence; the last column takes masked-off writes.
        self.block_table = zeros(S, max_pages + 1)
        self.pages_held = zeros(S)
        # Sequences whose pages were rotated out to the host mirror wait there, in these pages, to come back.
        self.rotated = zeros(S, dtype=torch.bool)
        self.host_table = zeros(S, max_pages + 1)
        self.host_held = zeros(S)
        # What happened to each request, reported when it finishes.
        self.preemptions = zeros(S)
        self.pages_out = zeros(S)
        self.pages_in = zeros(S)
        self.wait_s = zeros(S, dtype=torch.float64)
        self.output_counts = zeros(S, vocab_size, dtype=torch.int32)
        self.prompt_mask = zeros(S, vocab_size, dtype=torch.bool)
        self.num_preemptions = zeros()  # rotations out and recomputes, as vLLM counts swaps and recomputes
        self.num_recomputes = zeros()

    def write(self, slot: int, req: SlotRequest) -> None:
        """Host side: fill an EMPTY slot and publish it. The status is written last."""
        p = req.params
        n = len(req.prompt_token_ids)
        self.tokens[slot, :n] = torch.tensor(req.prompt_token_ids, dtype=torch.int32)
        for name, value in (
            ("arrival", req.arrival), ("priority", p.priority), ("ttft_deadline", req.ttft_deadline),
            ("service_class", int(p.service_class)),
            ("tpot_slo", p.tpot_slo_ms / 1000 if p.tpot_slo_ms else float("inf")),
            ("rotated", False), ("preemptions", 0), ("pages_out", 0), ("pages_in", 0), ("wait_s", 0.0),
            ("prompt_len", n), ("seq_len", n), ("num_computed", 0), ("max_tokens", req.max_tokens),
            ("ignore_eos", p.ignore_eos),
            ("temperature", p.temperature), ("top_p", p.top_p), ("top_k", p.top_k), ("min_p", p.min_p),
            ("repetition_penalty", p.repetition_penalty), ("presence_penalty", p.presence_penalty),
            ("frequency_penalty", p.frequency_penalty), ("seed", req.seed),
            ("finish_reason", FinishReason.NONE), ("cancel", False), ("paused", False),
        ):
            getattr(self, name)[slot] = value
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(p.stop_token_ids)] = torch.tensor(p.stop_token_ids, dtype=torch.int64)
        self.status[slot] = SlotStatus.SUBMITTED

    def release_slot(self, slot: int) -> None:
        """Host side: the slot's outputs have been read; it may take a new request."""
        self.status[slot] = SlotStatus.EMPTY
