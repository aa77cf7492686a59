"""The device modes' admission kernel (blink.engine.kernels.admission, in Triton's interpreter) lands records exactly
as the torch reference (blink.engine.core.admission.admit) does: every state tensor, admitted slots and the others,
over random records (values past the limits, ids outside the vocabulary, infinite and zero SLOs, seeds with the top
bit set) and a state full of an earlier request's leftovers."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernel

import numpy as np
import torch

from blink.engine.core.admission import admit, field_views, span
from blink.engine.core.state import Slots
from blink.engine.kernels import admission as admission_kernel
from blink.shared.request_schema import FIELDS
from blink.shared.slot_table import Geometry, slot_dtype

S, MAX_LEN, VOCAB = 8, 96, 50


def _records(rng: np.random.Generator, record: np.dtype) -> np.ndarray:
    records = np.zeros(S, dtype=record)
    for f in FIELDS:
        if f.wire == "<f4":
            values = rng.uniform(-1, 500, S).astype(np.float32)
            values[rng.random(S) < 0.3] = np.inf
            values[rng.random(S) < 0.1] = 0.0
        elif f.wire == "<u8":
            values = rng.integers(0, 2**63, S, dtype=np.uint64) | (rng.integers(0, 2, S, dtype=np.uint64) << 63)
        else:
            values = rng.integers(-3 if f.wire == "<i4" else 0, 200, S)
        records[f.name] = values
    records["prompt_len"] = rng.integers(1, MAX_LEN, S)
    records["num_stop_ids"] = rng.integers(0, records["stop_ids"].shape[1] + 1, S)
    records["stop_ids"] = rng.integers(-1, VOCAB, records["stop_ids"].shape)
    records["num_logit_bias"] = rng.integers(0, records["logit_bias_ids"].shape[1] + 1, S)
    records["logit_bias_ids"] = rng.integers(-5, VOCAB + 5, records["logit_bias_ids"].shape)
    records["logit_bias"] = rng.normal(size=records["logit_bias"].shape)
    records["page_hashes"] = rng.integers(-2**62, 2**62, records["page_hashes"].shape)
    return records


def _leftovers(state: Slots, seed: int) -> Slots:
    generator = torch.Generator().manual_seed(seed)
    for value in vars(state).values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.dtype.is_floating_point:
                value.copy_(torch.randn(value.shape, generator=generator, dtype=torch.float64))
            else:
                value.copy_(torch.randint(0, 2 if value.dtype == torch.bool else 9, value.shape, generator=generator))
    return state


def test_the_kernel_lands_records_as_admit_does():
    rng = np.random.default_rng(7)
    record = slot_dtype(Geometry(num_slots=S, max_prompt_tokens=64, window=4, page_size=8))
    start, size = span(record)
    for trial in range(4):
        records = _records(rng, record)
        raw = torch.from_numpy(np.ascontiguousarray(
            records.view(np.uint8).reshape(S, record.itemsize)[:, start:start + size]))
        admitted = torch.from_numpy(rng.random(S) < 0.6)
        now = torch.tensor([1234.5 + trial], dtype=torch.float64)
        arrival = torch.from_numpy(rng.integers(0, 1000, S))
        expected = _leftovers(Slots(S, MAX_LEN, 12, VOCAB, torch.device("cpu")), trial)
        got = _leftovers(Slots(S, MAX_LEN, 12, VOCAB, torch.device("cpu")), trial)
        admit(expected, admitted, field_views(raw, record), now, arrival, MAX_LEN)
        admission_kernel.admit(got, admitted, raw, record, now, arrival, MAX_LEN)
        for name, value in vars(expected).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(got, name), value), (trial, name)
