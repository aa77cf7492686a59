"""The host loop fed from the shared slot table: the engine service's data plane in `host` drive mode.

Engine slot i is slot-table slot i. Each step admits the slots the ingress published, mirrors their cancel
flags and window room into the step's state, runs the host loop and writes each slot's token, logprobs
and finish into the slot's output window.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from blink.engine.engine import Engine
from blink.engine.host_drive import HostLoop, SlotEvent
from blink.engine.sampling_params import SamplingParams
from blink.engine.state import SlotRequest
from blink.shared.slot_table import FLAG_IGNORE_EOS, Finish, SlotTable

_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}


class Fenced(RuntimeError):
    """The table moved to a newer epoch: a watchdog declared this engine dead and another took over."""


class TableDriver:
    def __init__(self, engine: Engine, table: SlotTable):
        if table.geometry.num_slots != engine.state.num_slots:
            raise ValueError("the slot table and the engine must have as many slots")
        self.engine, self.table = engine, table
        self.epoch = int(table.header["epoch"])
        self.loop = HostLoop(engine)
        self.resident: dict[int, SamplingParams] = {}
        self.max_running: int | None = None  # admission limit set over the control plane
        self._arrivals = 0

    def step(self) -> bool:
        """Admits, steps once and publishes; returns whether a step ran (False: idle, or every sequence paused).

        Checks the epoch before touching any slot: an engine that was stopped (SIGSTOP) and declared dead must
        not write into slots the ingress has since given to other requests."""
        self.check_epoch()
        self._admit()
        if not self.resident:
            return False
        slots = np.fromiter(self.resident, dtype=np.int64)
        table = self.table.slots  # field by field: whole records would copy prompts and windows each step
        cancel = table["cancel"][slots] != 0
        full = (table["produced"][slots].astype(np.int64) - table["consumed"][slots]) >= self.table.geometry.window
        state = self.engine.state
        index = torch.from_numpy(slots).to(state.cancel.device)
        state.cancel[index] = torch.from_numpy(cancel).to(state.cancel.device)
        state.paused[index] = torch.from_numpy(full).to(state.paused.device)
        events = self.loop.step(self.resident)
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
            if self.max_running is not None and len(self.resident) >= self.max_running:
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
            self.resident[slot] = params

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
            k = self.resident[slot].logprobs or 0
            top = list(event.top_logprobs.items())[:k]
            self.table.emit(slot, event.token, event.logprob or 0.0, [t for t, _ in top], [lp for _, lp in top])
        if event.finish_reason:
            self.table.finish(slot, _FINISH[event.finish_reason], event.stats)
            self.engine.state.release_slot(slot)
            del self.resident[slot]


def _slo(ms: np.float32) -> float | None:
    return float(ms) if math.isfinite(ms) and ms > 0 else None
