"""The `host` drive mode: a host loop that calls the step and syncs once per step.

It is the CPU path and the baseline the device loops are measured against. `HostLoop` runs one step over
whatever requests are resident in the engine's slots and reads its outputs back; `HostDriver` feeds it
from an in-process queue (the offline API), `blink.engine.table_drive` from the shared slot table.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from blink.engine.commit import StepOutput
from blink.engine.engine import Engine
from blink.engine.kv_cache import PagePool
from blink.engine.policy import StepCostModel
from blink.engine.sampler import GREEDY_BELOW, SamplerFeatures
from blink.engine.sampling_params import SamplingParams
from blink.engine.state import FinishReason, SlotRequest, SlotState
from blink.shared.slot_table import RequestStats

FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


@dataclass
class SlotEvent:
    """What one slot produced in a step: a token (or none, when it was aborted) and, last, its finish."""

    token: int | None
    logprob: float | None = None
    top_logprobs: dict[int, float] = field(default_factory=dict)
    finish_reason: str | None = None  # stop | length | abort
    stats: RequestStats | None = None  # with the finish


class HostLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.last_output: StepOutput | None = None  # kept for inspection (tests, debugging)
        self.ran = False  # whether the last call ran a step (False: nothing resident, or all paused)
        self.cost_model = StepCostModel(engine.step.cost)
        self._planned_at: float | None = None
        self.page_bytes = PagePool.bytes_per_page(engine.model_config, engine.pool.page_size)

    @torch.inference_mode()
    def step(self, resident: Mapping[int, SamplingParams]) -> dict[int, SlotEvent]:
        """One step over the resident slots (slot -> its request's params); returns each slot's event."""
        self.ran = False
        if not resident:
            self._planned_at = None  # nobody waited meanwhile
            return {}
        started = time.perf_counter()
        self.cost_model.planning(started - (self._planned_at or started))
        self._planned_at = started
        features = sampler_features(resident.values())
        step, mirror = self.engine.step, self.engine.step.mirror
        plan = step.plan(features)
        sizes = plan.sizes.tolist()
        if mirror and (sizes[4] or sizes[5]):
            mirror.begin(plan.moves, sizes[4], sizes[5])
        if sizes[0] == 0 and not self.engine.state.cancel[list(resident)].any():
            if mirror:
                mirror.end()
            return {}  # every resident sequence is paused or waiting; a cancelled one needs the commit to end it
        out = step.run(plan, step.shape_for(sizes), features)
        if mirror:
            mirror.end()
        self.last_output, self.ran = out, True
        events = _events(out, resident, features, self.engine.state, self.page_bytes)
        self.cost_model.observe(sizes[0], time.perf_counter() - started)
        return events


def sampler_features(params) -> SamplerFeatures:
    params = list(params)
    return SamplerFeatures(
        penalties=any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params),
        filtering=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
        random=any(p.temperature >= GREEDY_BELOW for p in params),
        logprobs=any(p.logprobs is not None for p in params),
    )


def _events(out: StepOutput, resident: Mapping[int, SamplingParams], features: SamplerFeatures,
            state: SlotState, page_bytes: int) -> dict[int, SlotEvent]:
    tokens, reasons = out.token.tolist(), out.finish_reason.tolist()
    if features.logprobs:
        logprob, top_ids, top_lp = out.logprob.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
    if any(reasons):
        counts = torch.stack([state.preemptions, state.pages_out, state.pages_in]).tolist()
        waited = state.wait_s.tolist()
    events = {}
    for slot, params in resident.items():
        token, reason = tokens[slot], reasons[slot]
        if token < 0 and reason == FinishReason.NONE:
            continue
        event = SlotEvent(token if token >= 0 else None)
        if params.logprobs is not None and token >= 0:
            event.logprob = logprob[slot]
            k = params.logprobs
            event.top_logprobs = dict(zip(top_ids[slot][:k], top_lp[slot][:k], strict=True))
            event.top_logprobs[token] = logprob[slot]
        if reason != FinishReason.NONE:
            event.finish_reason = FINISH_NAMES[FinishReason(reason)]
            out_pages, in_pages = counts[1][slot], counts[2][slot]
            event.stats = RequestStats(counts[0][slot], out_pages, in_pages, out_pages * page_bytes,
                                       in_pages * page_bytes, waited[slot] * 1000)
        events[slot] = event
    return events


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


class HostDriver:
    """Feeds the host loop from an in-process queue: requests wait there until a slot is free."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.state = engine.state
        self.loop = HostLoop(engine)
        self._queue: deque[_Pending] = deque()
        self._resident: dict[int, _Pending] = {}  # slot -> request
        self._free_slots = list(range(self.state.num_slots - 1, -1, -1))
        self._arrivals = 0
        self._seeds = random.Random(engine.config.seed)

    @property
    def last_output(self) -> StepOutput | None:
        return self.loop.last_output

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
        slot_events = self.loop.step({slot: p.params for slot, p in self._resident.items()})
        events = []
        for slot, e in slot_events.items():
            request_id = self._resident[slot].request_id
            if e.finish_reason:
                del self._resident[slot]
                self.state.release_slot(slot)
                self._free_slots.append(slot)
            events.append(TokenEvent(e.token, e.logprob, e.top_logprobs, e.finish_reason, e.stats,
                                     request_id=request_id))
        return events

    def _fill_slots(self) -> None:
        while self._queue and self._free_slots:
            pending = self._queue.popleft()
            slot = self._free_slots.pop()
            params = pending.params
            self.state.write(slot, SlotRequest(
                prompt_token_ids=pending.prompt_token_ids, params=params,
                seed=self._seeds.getrandbits(63) if params.seed is None else params.seed,
                arrival=self._arrivals, max_tokens=pending.max_tokens,
                ttft_deadline=pending.received + params.ttft_slo_ms / 1000 if params.ttft_slo_ms else float("inf"),
            ))
            self._arrivals += 1
            self._resident[slot] = pending
