"""The one admission: request records (blink.shared.request_schema) into the engine's per-slot state.

Every path goes through `admit`: the `host` mode with the records in the slot table's shared memory, the offline
API with records it writes itself, the device modes with the bytes their exchange kernel copied out of the mapped
table after its acquire loads (blink.engine.kernels.exchange). It is tensor code with no host read and no shape
that depends on data (masked writes over every slot), so the device modes capture it in their step graphs.

The prompt is not its business: whoever holds the record checks it and copies it into the token history, marks
its tokens for the penalties and clears the output counts (the host here, in `admit_records`; the device in the
exchange kernel), once per request rather than over every slot each step; an invalid record is ended there, never
admitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from blink.engine.core.state import Slots, SlotStatus
from blink.shared.request_schema import FIELDS, FIRST, MAX_LOGIT_BIAS, MAX_STOP_IDS

# How a field of each wire type is viewed in place: every u4 field holds values below 2**31, and the seed's top
# bit is masked off below, so signed views read them exactly.
_VIEW = {"<u4": torch.int32, "<i4": torch.int32, "<f4": torch.float32, "<u8": torch.int64}
_LANDED_OTHERWISE = {"max_tokens", "seed"}  # schema fields with a conversion of their own below
# What a new request starts from, whatever the slot held before.
_RESET = (("num_computed", 0), ("finish_reason", 0), ("cancel", False), ("paused", False), ("rotated", False),
          ("preemptions", 0), ("pages_out", 0), ("pages_in", 0), ("wait_s", 0.0), ("scored", 0), ("cached_tokens", 0))


def span(record: np.dtype) -> tuple[int, int]:
    """Where the schema's fields and the stop ids lie in a record: (first byte, bytes), what admission reads."""
    start = record.fields[FIRST][1]
    end = record.fields["prompt"][1]
    if start % 8:
        raise ValueError("the request's fields must start 8-byte aligned in the record")  # the seed is viewed as 8
    return start, -(-(end - start) // 8) * 8


def field_views(raw: torch.Tensor, record: np.dtype) -> dict[str, torch.Tensor]:
    """Typed per-slot views (no copies) of each field in `raw`, [slots, span bytes] of uint8 laid out as
    `record`'s span."""
    start, _ = span(record)
    views = {}
    for f in FIELDS:
        offset, size = record.fields[f.name][1] - start, np.dtype(f.wire).itemsize
        views[f.name] = raw[:, offset:offset + size].view(_VIEW[f.wire])[:, 0]
    for name, dtype in (("stop_ids", torch.int32), ("logit_bias_ids", torch.int32), ("logit_bias", torch.float32),
                        ("page_hashes", torch.int64)):
        array, offset = record.fields[name][:2]
        offset -= start
        views[name] = raw[:, offset:offset + array.itemsize].view(dtype)  # as many as the record holds
    return views


def admit(state: Slots, admitted: torch.Tensor, records: dict[str, torch.Tensor], now: torch.Tensor,
          arrival: torch.Tensor, max_len: int) -> None:
    """Copies the records of the `admitted` slots ([S] bool) into the state and marks them ADMITTED; the others
    keep theirs. records: field_views; now: [1] float64, seconds on the host's clock (for TTFT deadlines);
    arrival: [S] int64, each admitted request's arrival number."""

    def land(name: str, value: torch.Tensor | float) -> None:
        target = getattr(state, name)
        target.copy_(torch.where(admitted, value.to(target.dtype) if isinstance(value, torch.Tensor) else value,
                                 target))

    for f in FIELDS:
        if f.state is not None and f.name not in _LANDED_OTHERWISE:
            land(f.name, records[f.name])
    n = records["prompt_len"].long()
    land("seq_len", n)
    land("max_tokens", torch.minimum(records["max_tokens"].long().clamp(min=0), max_len - n))
    land("seed", records["seed"] & (2**63 - 1))
    inf = float("inf")
    ttft = records["ttft_slo_ms"].double()  # what remained of the SLO at publication
    land("ttft_deadline", torch.where(ttft.isfinite(), now + ttft / 1000, inf))
    tpot = records["tpot_slo_ms"].double()
    land("tpot_slo", torch.where(tpot.isfinite() & (tpot > 0), tpot / 1000, inf))
    given = torch.arange(MAX_STOP_IDS, device=n.device) < records["num_stop_ids"].long()[:, None]
    stops = torch.where(given, records["stop_ids"].long(), -1)
    state.stop_ids.copy_(torch.where(admitted[:, None], stops, state.stop_ids))
    # Ids outside the vocabulary are dropped here, whatever the edge checked: the sampler indexes by them.
    bias_ids = records["logit_bias_ids"].long()
    given = (torch.arange(MAX_LOGIT_BIAS, device=n.device) < records["num_logit_bias"].long()[:, None]) & (
        bias_ids >= 0) & (bias_ids < state.output_counts.shape[1])
    state.logit_bias_ids.copy_(torch.where(admitted[:, None], torch.where(given, bias_ids, -1), state.logit_bias_ids))
    state.logit_bias.copy_(torch.where(admitted[:, None], torch.where(given, records["logit_bias"], 0.0),
                                       state.logit_bias))
    # A hash per full page of the longest prompt the record holds (admission ends a prompt past the context).
    width = min(records["page_hashes"].shape[1], state.page_hashes.shape[1])
    hashes, held = records["page_hashes"][:, :width], state.page_hashes[:, :width]
    held.copy_(torch.where(admitted[:, None], hashes, held))
    land("arrival", arrival)
    for name, value in _RESET:
        land(name, value)
    land("status", SlotStatus.ADMITTED)


@dataclass(frozen=True)
class Admitted:
    """What `admit_records` did with the slots it was given."""

    slots: list[int]  # admitted, in the order given
    invalid: list[int]  # whose record is invalid: not admitted; their owner ends them
    # The records' request fields as admission copied them (field_views of its host copy, [records] each, indexed by
    # slot; empty when it admitted none): what the host reads of an admitted request, not the record again.
    fields: dict[str, torch.Tensor]


def admit_records(state: Slots, records: np.ndarray, slots: list[int], now: float, arrivals: int, vocab: int,
                  max_len: int) -> Admitted:
    """Host side: checks the records of `slots` (structured slot records: a table's, or the offline API's),
    copies their prompts and admits the valid ones, numbered from `arrivals` in the order `slots` lists them (the
    order they came in, where the caller knows it: the offline API's queue)."""
    valid, invalid, fields = [], [], {}
    for slot in slots:
        n = int(records[slot]["prompt_len"])
        prompt = records[slot]["prompt"][:n]
        if not 0 < n < max_len or prompt.min() < 0 or prompt.max() >= vocab:
            invalid.append(slot)
            continue
        ids = torch.from_numpy(prompt.astype(np.int64)).to(state.tokens.device)
        state.tokens[slot, :n] = ids.int()
        state.prompt_mask[slot] = False  # the penalties' bookkeeping, once per request
        state.prompt_mask[slot, ids] = True
        state.output_counts[slot] = 0
        valid.append(slot)
    if valid:
        device = state.status.device
        start, size = span(records.dtype)
        raw = records.view(np.uint8).reshape(len(records), records.dtype.itemsize)[:, start:start + size]
        admitted = torch.zeros(state.num_slots, dtype=torch.bool)
        admitted[valid] = True
        arrival = torch.zeros(state.num_slots, dtype=torch.int64)
        arrival[valid] = arrivals + torch.arange(len(valid))
        copied = torch.from_numpy(np.ascontiguousarray(raw))  # a copy: the ingress may write other slots
        fields = field_views(copied, records.dtype)
        admit(state, admitted.to(device), field_views(copied.to(device), records.dtype),
              torch.tensor([now], dtype=torch.float64, device=device), arrival.to(device), max_len)
    return Admitted(valid, invalid, fields)
