"""Model-free engine state for scheduler tests (vLLM's tests/v1/core/utils.py is the model): slots filled through
the one admission, a page pool without a model, and a step that advances what the plan scheduled as the commit
would, without sampling (each scheduled sequence that reaches its end gets one more token)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from blink.engine.core.admission import admit_records
from blink.engine.core.commit import advance
from blink.engine.core.kv_cache import PagePool
from blink.engine.core.policy import StepCost, policy_named
from blink.engine.core.rotation import HostMirror
from blink.engine.core.scheduler import StepPlan, plan
from blink.engine.core.state import Slots
from blink.shared.request_schema import Request
from blink.shared.slot_table import Geometry, slot_dtype, write_request

VOCAB = 100


@dataclass
class ModelFreeEngine:
    num_slots: int = 4
    max_len: int = 128
    page_size: int = 8
    num_pages: int = 64
    budget: int = 32
    policy: str = "fcfs"
    prompt_rows: int = 0  # prompt logprobs a step scores at most
    mirror_pages: int = 0  # a host mirror for KV rotation (the pages' contents are not copied: there are none)
    state: Slots = field(init=False)
    pool: PagePool = field(init=False)

    def __post_init__(self) -> None:
        cpu = torch.device("cpu")
        kv = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)  # only its shape
        self.pool = PagePool(kv, self.num_pages, self.page_size, cpu)
        self.state = Slots(self.num_slots, self.max_len, -(-self.max_len // self.page_size), VOCAB, cpu)
        self.geometry = Geometry(self.num_slots, self.max_len, window=1)
        self.records = np.zeros(self.num_slots, dtype=slot_dtype(self.geometry))
        self.cost = StepCost(cpu)
        self.arrivals = 0
        self.mirror = HostMirror(self.pool, self.mirror_pages) if self.mirror_pages else None

    def add(self, slot: int, prompt_len: int, max_tokens: int = 64, **fields) -> None:
        """A request of `prompt_len` tokens into `slot`, admitted as the engine admits one."""
        write_request(self.records[slot], Request(list(range(1, prompt_len + 1)), max_tokens, **fields),
                      self.geometry)
        assert admit_records(self.state, self.records, [slot], time.monotonic(), self.arrivals, VOCAB,
                             self.max_len).invalid == []
        self.arrivals += 1

    def step(self) -> StepPlan:
        """Plans one step and advances what it scheduled; returns the plan."""
        s = self.state
        planned = plan(s, self.pool, self.budget, policy_named(self.policy), self.mirror, self.cost, self.prompt_rows)
        advance(s, planned)
        done = (planned.take > 0) & (s.num_computed == s.seq_len)
        s.tokens[done.nonzero()[:, 0], s.seq_len[done]] = 1
        s.seq_len += done.long()
        return planned

    def takes(self, planned: StepPlan) -> list[int]:
        return planned.take.tolist()
