"""The `host` drive mode: a host loop that calls the step and syncs once per step.

It is the CPU path and the baseline the device loops are measured against. `HostLoop` runs one step over
whatever requests are resident in the engine's slots and reads its outputs back. `HostDriver` feeds it from the
shared slot table, in a thread of the engine service: engine slot i is slot-table slot i; each step admits the
slots the ingress published, mirrors their cancel flags and window room into the step's state, steps, and writes
each slot's token, logprobs and finish into the slot's output window. (`blink.engine.offline_drive` feeds the same
loop from an in-process queue.)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from blink.engine.commit import StepOutput
from blink.engine.driver import Fenced
from blink.engine.engine import Engine
from blink.engine.kv_cache import PagePool
from blink.engine.policy import StepCostModel
from blink.engine.sampler import GREEDY_BELOW, SamplerFeatures
from blink.engine.sampling_params import SamplingParams
from blink.engine.state import FinishReason, SlotRequest, SlotState
from blink.shared.slot_table import FLAG_IGNORE_EOS, Finish, RequestStats, SlotTable

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
        self.mirror = engine.mirror  # KV rotation: the host reads the plan's move counts between its halves
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
        step, mirror = self.engine.step, self.mirror
        plan = step.plan(features, mirror)
        sizes = plan.sizes.tolist()
        if mirror and (sizes[4] or sizes[5]):
            mirror.begin(plan.moves, sizes[4], sizes[5])
        if sizes[0] == 0 and not self.engine.state.cancel[list(resident)].any():
            if mirror:
                mirror.end()
            return {}  # every resident sequence is paused or waiting; a cancelled one needs the commit to end it
        out = step.run(plan, step.shape_for(sizes), features, mirror)
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


IDLE_BACKOFF_S = (0.0002, 0.005)  # an idle loop naps this long, doubling: wakes within ~5 ms


class HostDriver:
    """The `host` drive mode over the slot table (a Driver)."""

    mode = "host"
    limitations = ()

    def __init__(self, engine: Engine, table: SlotTable):
        if table.geometry.num_slots != engine.state.num_slots:
            raise ValueError("the slot table and the engine must have as many slots")
        self.engine, self.table = engine, table
        self.epoch = int(table.header["epoch"])
        self.loop = HostLoop(engine)
        self.mirror = self.loop.mirror
        self.params: dict[int, SamplingParams] = {}  # resident slot -> its request's parameters
        self.max_running: int | None = None  # admission limit set over the control plane
        self.failure: BaseException | None = None
        self._arrivals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def resident(self) -> int:
        return len(self.params)

    def set_admission_limit(self, limit: int | None) -> None:
        self.max_running = limit

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="host-drive", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        self.stop()

    def _run(self) -> None:
        nap = 0.0
        try:
            while not self._stop.is_set():
                if self.step():
                    nap = 0.0
                    continue
                self.table.heartbeat()  # idle is alive too (step() checked the epoch)
                nap = min(IDLE_BACKOFF_S[1], nap * 2 or IDLE_BACKOFF_S[0])
                time.sleep(nap)
        except BaseException as e:  # the service learns of it and exits; the watchdog restarts the engine
            self.failure = e

    def step(self) -> bool:
        """Admits, steps once and publishes; returns whether a step ran (False: idle, or every sequence paused).

        Checks the epoch before touching any slot: an engine that was stopped (SIGSTOP) and declared dead must
        not write into slots the ingress has since given to other requests."""
        self.check_epoch()
        self._admit()
        if not self.params:
            return False
        slots = np.fromiter(self.params, dtype=np.int64)
        table = self.table.slots  # field by field: whole records would copy prompts and windows each step
        cancel = table["cancel"][slots] != 0
        full = (table["produced"][slots].astype(np.int64) - table["consumed"][slots]) >= self.table.geometry.window
        state = self.engine.state
        index = torch.from_numpy(slots).to(state.cancel.device)
        state.cancel[index] = torch.from_numpy(cancel).to(state.cancel.device)
        state.paused[index] = torch.from_numpy(full).to(state.paused.device)
        events = self.loop.step(self.params)
        self.check_epoch()
        for slot, event in events.items():
            self._publish(slot, event)
        self.table.heartbeat()
        return self.loop.ran

    def check_epoch(self) -> None:
        if int(self.table.header["epoch"]) != self.epoch:
            raise Fenced(f"the slot table is in epoch {int(self.table.header['epoch'])}, this engine's was "
                         f"{self.epoch}")

    def _admit(self) -> None:
        for slot in self.table.submitted().tolist():
            if self.max_running is not None and len(self.params) >= self.max_running:
                return  # the rest stay SUBMITTED until a request finishes
            record = self.table.slots[slot]
            try:
                params, request = self._request(record)
            except ValueError:
                # The ingress validates; a record that still fails is ended, not served.
                self.table.admit(slot)
                self.table.finish(slot, Finish.ABORT)
                continue
            self.engine.state.write(slot, request)
            self.table.admit(slot)
            self.params[slot] = params

    def _request(self, r: np.void) -> tuple[SamplingParams, SlotRequest]:
        n = int(r["prompt_len"])
        prompt = r["prompt"][:n].tolist()
        vocab, limit = self.engine.model_config.vocab_size, self.engine.max_model_len
        if not 0 < n < limit or min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError("prompt out of range")
        logprobs = int(r["logprobs"])
        params = SamplingParams(
            temperature=float(r["temperature"]), top_p=float(r["top_p"]), top_k=int(r["top_k"]),
            min_p=float(r["min_p"]), max_tokens=max(1, int(r["max_tokens"])),
            repetition_penalty=float(r["repetition_penalty"]), presence_penalty=float(r["presence_penalty"]),
            frequency_penalty=float(r["frequency_penalty"]), seed=int(r["seed"]) & (2**63 - 1),
            logprobs=logprobs if logprobs >= 0 else None, priority=int(r["priority"]),
            ignore_eos=bool(int(r["flags"]) & FLAG_IGNORE_EOS),
            stop_token_ids=r["stop_ids"][: int(r["num_stop_ids"])].tolist(),
            service_class=int(r["service_class"]), tpot_slo_ms=_slo(r["tpot_slo_ms"]),
        )
        # The record holds what remained of the TTFT SLO when it was published: a deadline on this host's clock.
        ttft = float(r["ttft_slo_ms"])
        deadline = time.monotonic() + ttft / 1000 if math.isfinite(ttft) else math.inf
        request = SlotRequest(prompt, params, seed=params.seed, arrival=self._arrivals,
                              max_tokens=min(params.max_tokens, limit - n), ttft_deadline=deadline)
        self._arrivals += 1
        return params, request

    def _publish(self, slot: int, event: SlotEvent) -> None:
        if event.token is not None:
            k = self.params[slot].logprobs or 0
            top = list(event.top_logprobs.items())[:k]
            self.table.emit(slot, event.token, event.logprob or 0.0, [t for t, _ in top], [lp for _, lp in top])
        if event.finish_reason:
            self.table.finish(slot, _FINISH[event.finish_reason], event.stats)
            self.engine.state.release_slot(slot)
            del self.params[slot]


_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}


def _slo(ms: np.float32) -> float | None:
    return float(ms) if math.isfinite(ms) and ms > 0 else None
