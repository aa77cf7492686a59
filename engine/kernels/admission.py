"""Admission as one Triton kernel: blink.engine.core.admission.admit (the torch reference) for the device modes.

The torch `admit` lands each field with a masked write over every slot: about a hundred small ops, a kernel each in a
captured step, every step, whether anything was admitted or not. This is the same landing in one launch, a program per
slot that returns at once unless its slot was admitted (tests/engine/test_admission_kernel.py holds it to `admit`). The
fields come from blink.shared.request_schema.FIELDS at launch: a field added there lands here with no edit.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from blink.engine.core.admission import _LANDED_OTHERWISE, _RESET, span
from blink.engine.core.state import Slots, SlotStatus
from blink.shared.request_schema import FIELDS, MAX_LOGIT_BIAS, MAX_STOP_IDS

ADMITTED = tl.constexpr(int(SlotStatus.ADMITTED))
assert all(value == 0 for _, value in _RESET), "the kernel resets fields to zero"


@triton.jit
def _word(record, at: tl.constexpr, FLOAT: tl.constexpr):
    """A 4-byte field of the record, as the torch views read it (every u4 field holds values below 2**31)."""
    if FLOAT:
        return tl.load((record + at).to(tl.pointer_type(tl.float32)))
    else:
        return tl.load((record + at).to(tl.pointer_type(tl.int32)))


@triton.jit
def _land(requests, admitted, now, arrival, max_len, vocab,
          plain, PLAIN_AT: tl.constexpr, PLAIN_FLOAT: tl.constexpr, resets,
          seq_len, max_tokens, seed, ttft_deadline, tpot_slo, arrival_out, status,
          stop_ids, logit_bias_ids, logit_bias, page_hashes, hashes_stride,
          SPAN: tl.constexpr, PROMPT_LEN_AT: tl.constexpr, MAX_TOKENS_AT: tl.constexpr, SEED_AT: tl.constexpr,
          TTFT_AT: tl.constexpr, TPOT_AT: tl.constexpr, NUM_STOPS_AT: tl.constexpr, STOPS_AT: tl.constexpr,
          NUM_BIAS_AT: tl.constexpr, BIAS_IDS_AT: tl.constexpr, BIAS_AT: tl.constexpr, HASHES_AT: tl.constexpr,
          HASHES: tl.constexpr, STOPS: tl.constexpr, BIASES: tl.constexpr, BLOCK_H: tl.constexpr):
    s = tl.program_id(0)
    if not tl.load(admitted + s):
        return
    record = requests + s.to(tl.int64) * SPAN
    for i in tl.static_range(len(PLAIN_AT)):  # the fields copied as they are, converted to the state's dtype
        target = plain[i]
        tl.store(target + s, _word(record, PLAIN_AT[i], PLAIN_FLOAT[i]).to(target.dtype.element_ty))
    for i in tl.static_range(len(resets)):  # what a new request starts from, whatever the slot held
        target = resets[i]
        tl.store(target + s, tl.zeros((), target.dtype.element_ty))
    n = _word(record, PROMPT_LEN_AT, False).to(tl.int64)
    tl.store(seq_len + s, n)
    tl.store(max_tokens + s, tl.minimum(tl.maximum(_word(record, MAX_TOKENS_AT, False).to(tl.int64), 0), max_len - n))
    tl.store(seed + s, tl.load((record + SEED_AT).to(tl.pointer_type(tl.int64))) & 0x7FFFFFFFFFFFFFFF)
    inf = float("inf")
    ttft = _word(record, TTFT_AT, True).to(tl.float64)  # what remained of the SLO at publication
    finite = (ttft == ttft) & (ttft != inf) & (ttft != -inf)
    tl.store(ttft_deadline + s, tl.where(finite, tl.load(now) + ttft / 1000, inf))
    tpot = _word(record, TPOT_AT, True).to(tl.float64)
    finite = (tpot == tpot) & (tpot != inf) & (tpot != -inf)
    tl.store(tpot_slo + s, tl.where(finite & (tpot > 0), tpot / 1000, inf))
    tl.store(arrival_out + s, tl.load(arrival + s))
    j = tl.arange(0, STOPS)
    given = j < _word(record, NUM_STOPS_AT, False)
    stops = tl.load((record + STOPS_AT).to(tl.pointer_type(tl.int32)) + j)
    tl.store(stop_ids + s * STOPS + j, tl.where(given, stops.to(tl.int64), -1))
    # Ids outside the vocabulary are dropped here, whatever the edge checked: the sampler indexes by them.
    j = tl.arange(0, BIASES)
    ids = tl.load((record + BIAS_IDS_AT).to(tl.pointer_type(tl.int32)) + j).to(tl.int64)
    given = (j < _word(record, NUM_BIAS_AT, False)) & (ids >= 0) & (ids < vocab)
    tl.store(logit_bias_ids + s * BIASES + j, tl.where(given, ids, -1))
    bias = tl.load((record + BIAS_AT).to(tl.pointer_type(tl.float32)) + j)
    tl.store(logit_bias + s * BIASES + j, tl.where(given, bias, 0.0))
    h = tl.arange(0, BLOCK_H)
    hashes = tl.load((record + HASHES_AT).to(tl.pointer_type(tl.int64)) + h, mask=h < HASHES)
    tl.store(page_hashes + s.to(tl.int64) * hashes_stride + h, hashes, mask=h < HASHES)
    tl.store(status + s, ADMITTED)


def admit(state: Slots, admitted: torch.Tensor, requests: torch.Tensor, record: np.dtype, now: torch.Tensor,
          arrival: torch.Tensor, max_len: int) -> None:
    """`admit`'s landing in one launch. requests: [S, span] uint8, the records' request fields laid out as
    `record`'s span (what the exchange kernel copies out of the table); the rest as `admit`'s."""
    start, size = span(record)

    def at(name: str) -> int:
        return record.fields[name][1] - start

    plain = [f for f in FIELDS if f.state is not None and f.name not in _LANDED_OTHERWISE]
    hashes = min(record.fields["page_hashes"][0].shape[0], state.page_hashes.shape[1])
    assert record.fields["stop_ids"][0].shape[0] == MAX_STOP_IDS and state.page_hashes.stride(1) == 1
    _land[(state.num_slots,)](
        requests, admitted, now, arrival, max_len, state.output_counts.shape[1],
        tuple(getattr(state, f.name) for f in plain), tuple(at(f.name) for f in plain),
        tuple(f.wire[1] == "f" for f in plain), tuple(getattr(state, name) for name, _ in _RESET),
        state.seq_len, state.max_tokens, state.seed, state.ttft_deadline, state.tpot_slo, state.arrival, state.status,
        state.stop_ids, state.logit_bias_ids, state.logit_bias, state.page_hashes, state.page_hashes.stride(0),
        SPAN=size, PROMPT_LEN_AT=at("prompt_len"), MAX_TOKENS_AT=at("max_tokens"), SEED_AT=at("seed"),
        TTFT_AT=at("ttft_slo_ms"), TPOT_AT=at("tpot_slo_ms"), NUM_STOPS_AT=at("num_stop_ids"),
        STOPS_AT=at("stop_ids"), NUM_BIAS_AT=at("num_logit_bias"), BIAS_IDS_AT=at("logit_bias_ids"),
        BIAS_AT=at("logit_bias"), HASHES_AT=at("page_hashes"), HASHES=hashes, STOPS=MAX_STOP_IDS,
        BIASES=MAX_LOGIT_BIAS, BLOCK_H=triton.next_power_of_2(max(hashes, 1)))
