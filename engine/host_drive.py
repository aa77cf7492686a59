"""The `host` drive mode: a host loop that calls the step and syncs once per step.

It is the CPU path and the baseline the device loops are measured against. Per step it fills empty
slots from its queue, plans, reads the live-token count to pick a bucket, runs the step and reads the
step's outputs back.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from blink.engine.commit import StepOutput
from blink.engine.engine import Engine
from blink.engine.sampler import SamplerFeatures
from blink.engine.sampling_params import SamplingParams
from blink.engine.state import FinishReason, SlotRequest


@dataclass
class TokenEvent:
    """One generated token (or none, for a request aborted before producing one) and, last, the finish."""

    request_id: str
    token: int | None
    logprob: float | None = None
    top_logprobs: dict[int, float] = field(default_factory=dict)
    finish_reason: str | None = None  # stop | length | abort, on the request's last event


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    received: float = field(default_factory=time.monotonic)


_FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


class HostDriver:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.state = engine.state
        self._queue: deque[_Pending] = deque()
        self._resident: dict[int, _Pending] = {}  # slot -> request
        self._free_slots = list(range(self.state.num_slots - 1, -1, -1))
        self._arrivals = 0
        self._seeds = random.Random(engine.config.seed)
        self.last_output: StepOutput | None = None  # kept for inspection (tests, debugging)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    max_tokens: int) -> None:
        self._queue.append(_Pending(request_id, prompt_token_ids, params, max_tokens))

    def abort(self, request_id: str) -> list[TokenEvent]:
        """Queued requests end at once; resident ones are cancelled by the next step."""
        for pending in list(self._queue):
            if pending.request_id == request_id:
                self._queue.remove(pending)
                return [TokenEvent(request_id, None, finish_reason="abort")]
        for slot, pending in self._resident.items():
            if pending.request_id == request_id:
                self.state.cancel[slot] = True
        return []

    def has_work(self) -> bool:
        return bool(self._queue or self._resident)

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        self._fill_slots()
        if not self._resident:
            return []
        features = self._features()
        step = self.engine.step
        plan = step.plan(features)
        sizes = plan.sizes.tolist()
        if sizes[0] == 0:
            raise RuntimeError("scheduler planned an empty step while requests are resident")
        out = step.run(plan, step.shape_for(sizes), features)
        self.last_output = out
        return self._collect(out, features)

    def _fill_slots(self) -> None:
        while self._queue and self._free_slots:
            pending = self._queue.popleft()
            slot = self._free_slots.pop()
            params = pending.params
            self.state.write(slot, SlotRequest(
                prompt_token_ids=pending.prompt_token_ids, params=params,
                seed=self._seeds.getrandbits(63) if params.seed is None else params.seed,
                arrival=self._arrivals, max_tokens=pending.max_tokens,
                deadline=pending.received + params.deadline_ms / 1000 if params.deadline_ms else float("inf"),
            ))
            self._arrivals += 1
            self._resident[slot] = pending

    def _features(self) -> SamplerFeatures:
        params = [p.params for p in self._resident.values()]
        return SamplerFeatures(
            penalties=any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params),
            filtering=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
            random=any(p.temperature > 0 for p in params),
            logprobs=any(p.logprobs is not None for p in params),
        )

    def _collect(self, out: StepOutput, features: SamplerFeatures) -> list[TokenEvent]:
        tokens = out.token.tolist()
        reasons = out.finish_reason.tolist()
        if features.logprobs:
            logprob, top_ids, top_lp = out.logprob.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        events = []
        for slot, pending in list(self._resident.items()):
            token, reason = tokens[slot], reasons[slot]
            if token < 0 and reason == FinishReason.NONE:
                continue
            event = TokenEvent(pending.request_id, token if token >= 0 else None)
            wanted = pending.params.logprobs
            if wanted is not None and token >= 0:
                event.logprob = logprob[slot]
                event.top_logprobs = dict(zip(top_ids[slot][:wanted], top_lp[slot][:wanted], strict=True))
                event.top_logprobs[token] = logprob[slot]
            if reason != FinishReason.NONE:
                event.finish_reason = _FINISH_NAMES[FinishReason(reason)]
                del self._resident[slot]
                self.state.release_slot(slot)
                self._free_slots.append(slot)
            events.append(event)
        return events
