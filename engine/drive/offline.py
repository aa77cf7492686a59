"""The offline API's driver: requests wait in an in-process queue until a slot is free, then the host step steps
them (the host mode's `HostRank`, without output windows; blink.engine.llm runs it until every request has
finished)."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from blink.engine.core.commit import StepOutput
from blink.engine.drive.host import HostRank, SlotEvent
from blink.engine.engine import Engine
from blink.engine.sampling_params import SamplingParams
from blink.shared.request_schema import Request, request_of
from blink.shared.slot_table import slot_dtype, write_request


@dataclass
class TokenEvent(SlotEvent):
    request_id: str = ""


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    received: float = field(default_factory=time.monotonic)


class OfflineDriver:
    """Feeds the host mode's `HostRank` from an in-process queue: requests wait there until a slot is free."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.state = engine.state
        self.rank = HostRank(engine)
        self._queue: deque[_Pending] = deque()
        self._resident: dict[int, _Pending] = {}  # slot -> request
        self._free_slots = list(range(self.state.num_slots - 1, -1, -1))
        # The slot records requests are written into, as the ingress writes them into the slot table: admission
        # reads them as it reads the table's.
        self.geometry = engine.geometry(window=1)
        self.records = np.zeros(self.state.num_slots, dtype=slot_dtype(self.geometry))
        self._seeds = random.Random(engine.config.seed)

    @property
    def last_output(self) -> StepOutput | None:
        return self.rank.last_output

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    max_tokens: int) -> None:
        self._queue.append(_Pending(request_id, prompt_token_ids, params, max_tokens))

    def abort(self, request_id: str) -> list[TokenEvent]:
        """Queued requests end at once; resident ones are cancelled by the next step."""
        for pending in list(self._queue):
            if pending.request_id == request_id:
                self._queue.remove(pending)
                return [TokenEvent(None, finish_reason="abort", request_id=request_id)]
        for slot, pending in self._resident.items():
            if pending.request_id == request_id:
                self.state.cancel[slot] = True
        return []

    def abort_all(self) -> None:
        for pending in list(self._queue) + list(self._resident.values()):
            self.abort(pending.request_id)

    def has_work(self) -> bool:
        return bool(self._queue or self._resident)

    def step(self) -> list[TokenEvent]:
        self._fill_slots()
        events = []
        for slot, e in self.rank.step(None).items():
            request_id = self._resident[slot].request_id
            if e.finish_reason:  # the rank let the slot go
                del self._resident[slot]
                self._free_slots.append(slot)
            events.append(TokenEvent(e.tokens, e.finish_reason, e.stats, e.prompt, request_id=request_id))
        return events

    def _fill_slots(self) -> None:
        slots, now = [], time.monotonic()
        while self._queue and self._free_slots:
            pending = self._queue.popleft()
            slot = self._free_slots.pop()
            write_request(self.records[slot], self._request(pending, now), self.geometry)
            self._resident[slot] = pending
            slots.append(slot)
        if not slots:
            return
        engine = self.engine
        if engine.shard is not None:  # rank 0's records and clock: its deadlines, on every rank
            engine.shard.from_first(torch.from_numpy(self.records.view(np.uint8)))
            now = float(engine.shard.from_first(torch.tensor([now], dtype=torch.float64))[0])
        invalid = self.rank.admit(self.records, slots, now)  # in queue order: their arrival order
        if invalid:  # LLM checked every prompt before queueing it
            raise RuntimeError(f"invalid requests reached slots {invalid}")

    def _request(self, pending: _Pending, now: float) -> Request:
        params = pending.params
        ttft_left_ms = params.ttft_slo_ms - (now - pending.received) * 1000 if params.ttft_slo_ms else None
        seed = self._seeds.getrandbits(63) if params.seed is None else params.seed
        grammar = params.structured_outputs.spec() if params.structured_outputs else None
        return request_of(params, pending.prompt_token_ids, pending.max_tokens, seed, int(params.service_class),
                          ttft_left_ms, params.tpot_slo_ms, params.logprobs, params.prompt_logprobs, grammar=grammar)
