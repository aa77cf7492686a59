"""The `host` drive mode: a host loop that calls the step and syncs once per step.

It is the CPU path and the baseline the device loops are measured against. Two layers: `HostDriver` owns the
shared slot table, in a thread of the engine service (engine slot i is slot-table slot i): each step it admits the
slots the ingress published, reads their cancel flags and window room (`Windows`), has the rank step, and writes
each slot's token, logprobs and finish into the slot's output window. `HostRank` is the engine's side, what every
tensor-parallel rank does alike (blink.engine.drive.follower runs the others; blink.engine.drive.offline feeds it
from an in-process queue): it admits records, mirrors the windows into the engine's slots, runs
`blink.engine.core.step.Step` (plan, then the rest on buckets the plan's sizes pick) and reads each slot's event
back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from blink.engine.core.admission import Admitted, admit_records
from blink.engine.core.commit import PromptScores, StepOutput
from blink.engine.core.grammar import SlotGrammars
from blink.engine.core.policy import HostStepCostModel
from blink.engine.core.sampler import SamplerFeatures, features_asked
from blink.engine.core.state import Slots
from blink.engine.drive.driver import Fenced
from blink.engine.engine import Engine
from blink.engine.ranks import Ranks
from blink.shared.slot_table import FINISH_NAMES, Finish, RequestStats, SlotTable, TokenLogprob, window_room


@dataclass
class Sampled:
    """One generated token, with its logprob and the k most likely tokens where the request asked for them."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)

    @property
    def top_logprobs(self) -> dict[int, float]:
        """The top tokens and the sampled one, as the offline API gives them."""
        return {**dict(self.top), self.token: self.logprob} if self.logprob is not None else {}


@dataclass
class SlotEvent:
    """What one slot produced in a step: the prompt tokens it scored (if it asked), its tokens (none: aborted, or
    still in its prompt; several: drafts accepted) and, last, its finish."""

    tokens: list[Sampled] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    stats: RequestStats | None = None  # with the finish
    prompt: list[TokenLogprob] = field(default_factory=list)  # the prompt tokens it scored, in order

    @property
    def token_ids(self) -> list[int]:
        return [s.token for s in self.tokens]

    @property
    def token(self) -> int | None:
        """The slot's one token (None: none), for a caller stepping without drafts; never drops a token: with
        several (drafts accepted) it raises, and `tokens` is what to read."""
        if len(self.tokens) > 1:
            raise ValueError(f"the slot emitted {len(self.tokens)} tokens this step (speculative decoding): read "
                             "`tokens`")
        return self.tokens[0].token if self.tokens else None


@dataclass(frozen=True)
class Asked:
    """What a resident request asked of the sampler, taken once at admission from the fields admission copied: the
    host picks each step's sampler features and the top logprobs to publish from these, without reading the engine's
    state."""

    features: SamplerFeatures
    logprobs: int  # top logprobs per token; -1: none
    prompt_logprobs: int = -1  # top logprobs per prompt token; -1: none

    @classmethod
    def of(cls, admitted: Admitted) -> dict[int, Asked]:
        """Each admitted slot's, from `admitted.fields` (host tensors indexed by slot)."""
        if not admitted.slots:
            return {}
        index = torch.tensor(admitted.slots)
        fields = {name: view[index] for name, view in admitted.fields.items()}
        asked = features_asked(fields)
        rows = torch.stack(list(asked.values()), 1).tolist()
        logprobs, prompt_logprobs = fields["logprobs"].tolist(), fields["prompt_logprobs"].tolist()
        return {slot: cls(SamplerFeatures(**dict(zip(asked, row, strict=True))), logprobs[i], prompt_logprobs[i])
                for i, (slot, row) in enumerate(zip(admitted.slots, rows, strict=True))}


def merged_features(asked: Iterable[Asked]) -> SamplerFeatures:
    """What a step must do for all of these requests together."""
    asked = list(asked)
    return SamplerFeatures(**{name: any(getattr(a.features, name) for a in asked)
                              for name in SamplerFeatures.__dataclass_fields__})


@dataclass(frozen=True)
class Windows:
    """Each resident slot's cancel flag and output room, read from the slot table before a step."""

    slots: np.ndarray  # the resident slots, in admission order
    cancel: np.ndarray  # bool
    room: np.ndarray  # output entries the slot's window has room for (window_room); none pauses it


class HostRank:
    """The engine's side of a host step, the same on every rank (with tensor parallelism, rank 0 reads the slot
    table and the others step on what it sends them: blink.engine.drive.follower): admits records, mirrors the
    windows into the engine's slots, plans, runs the step when it has work, reads each slot's event back, and lets
    go of the requests that finished."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.mirror = engine.mirror  # KV rotation: the host reads the plan's move counts between its halves
        self.asked: dict[int, Asked] = {}  # resident slot -> what its request asked
        self.last_output: StepOutput | None = None  # kept for inspection (tests, debugging)
        self.ran = False  # whether the last step ran the model (False: nothing resident, or all paused)
        self.cost_model = HostStepCostModel(engine.step.cost)  # timed on the host's clock
        self.page_bytes = engine.pool.page_bytes  # in the pages' dtype (FP8 pages: half)
        self._planned_at: float | None = None
        self._arrivals = 0
        self.grammars = SlotGrammars(engine.tokenizer.raw, engine.model_config.vocab_size,
                                     list(engine.generation.eos_token_ids), engine.config.structured_outputs_backend)
        engine.step.grammar = self.grammars  # structured outputs: the step masks their rows

    def admit(self, records: np.ndarray, slots: list[int], now: float) -> list[int]:
        """records: indexed by slot. Returns the slots whose record is invalid: not admitted."""
        engine = self.engine
        admitted = admit_records(engine.state, records, slots, now, self._arrivals, engine.model_config.vocab_size,
                                 engine.max_model_len)
        self.asked.update(Asked.of(admitted))
        self._arrivals += len(admitted.slots)
        for slot in self.grammars.admit(records, admitted.slots):  # compiled already where HostDriver admits
            engine.state.cancel[slot] = True
        if admitted.slots:  # the grammar masks one row per slot: a constrained slot decodes without drafts
            draft_off = engine.state.draft_off
            draft_off[admitted.slots] = torch.tensor([slot in self.grammars.matchers for slot in admitted.slots],
                                                     device=draft_off.device)
        return admitted.invalid

    def step(self, windows: Windows | None) -> dict[int, SlotEvent]:
        """One step over the resident requests, their windows as given (None: no reader's window limits them, as
        in the offline API); returns each slot's event."""
        state = self.engine.state
        if windows is not None:
            index = torch.from_numpy(windows.slots).to(state.cancel.device)
            state.cancel[index] = torch.from_numpy(windows.cancel).to(state.cancel.device)
            state.paused[index] = torch.from_numpy(windows.room <= 0).to(state.paused.device)
            state.room[index] = torch.from_numpy(windows.room).to(state.room.device)
        events = self._run()
        for slot, event in events.items():
            for token in event.token_ids:  # one: a constrained slot never drafts
                self.grammars.advance(slot, token)
            if event.finish_reason:
                self.grammars.release(slot)
                state.release_slot(slot)
                del self.asked[slot]
        return events

    @torch.inference_mode()
    def _run(self) -> dict[int, SlotEvent]:
        """Plans, then runs the rest of the step unless it has nothing to compute or end; returns each slot's event."""
        self.ran = False
        resident = self.asked
        if not resident:
            self._planned_at = None  # nobody waited meanwhile
            return {}
        started = time.perf_counter()
        self.cost_model.planning(started - (self._planned_at or started))
        self._planned_at = started
        features = merged_features(resident.values())
        step, mirror = self.engine.step, self.mirror
        plan = step.plan(features, mirror)
        sizes = plan.read_sizes()
        if mirror and (sizes.pages_out or sizes.pages_in):
            mirror.begin(plan.moves, sizes.pages_out, sizes.pages_in)
        if sizes.tokens == 0 and not self.engine.state.cancel[list(resident)].any():
            if mirror:
                mirror.end()
            return {}  # every resident sequence is paused or waiting; a cancelled one needs the commit to end it
        out = step.run(plan, step.shape_for(sizes), features, mirror)
        if mirror:
            mirror.end()
        self.last_output, self.ran = out, True
        events = _events(out, resident, features, self.engine.state, self.page_bytes)
        self.cost_model.observe(sizes.tokens, time.perf_counter() - started)
        return events


def _events(out: StepOutput, resident: Mapping[int, Asked], features: SamplerFeatures, state: Slots,
            page_bytes: int) -> dict[int, SlotEvent]:
    runs = _runs(out, features)
    reasons = out.finish_reason.tolist()
    if any(reasons):
        counts = torch.stack([state.preemptions, state.pages_out, state.pages_in, state.cached_tokens]).tolist()
        waited = state.wait_s.tolist()
    scored = _scored(out.prompt, resident) if out.prompt is not None else {}
    events = {}
    for slot, asked in resident.items():
        tokens, reason = runs[slot], reasons[slot]
        if not tokens and reason == Finish.NONE and slot not in scored:
            continue
        event = SlotEvent(prompt=scored.get(slot, []))
        k = asked.logprobs
        for token, logprob, top_ids, top_lp in tokens:
            event.tokens.append(Sampled(token) if k < 0 or logprob is None else
                                Sampled(token, logprob, list(zip(top_ids[:k], top_lp[:k], strict=True))))
        if reason != Finish.NONE:
            event.finish_reason = FINISH_NAMES[Finish(reason)]
            out_pages, in_pages = counts[1][slot], counts[2][slot]
            event.stats = RequestStats(counts[0][slot], out_pages, in_pages, out_pages * page_bytes,
                                       in_pages * page_bytes, counts[3][slot], waited[slot] * 1000)
        events[slot] = event
    return events


def _runs(out: StepOutput, features: SamplerFeatures) -> list[list[tuple]]:
    """Each slot's tokens this step, in order, as (token, logprob, top ids, top logprobs); the logprobs None where
    the step computed none. One read of each tensor."""
    runs = out.runs
    if runs is None:  # a token per slot
        tokens = [[t] if t >= 0 else [] for t in out.token.tolist()]
        parts = (out.logprob, out.top_ids, out.top_logprobs)
    else:
        tokens = [row[:n] for row, n in zip(runs.token.tolist(), runs.count.tolist(), strict=True)]
        parts = (runs.logprob, runs.top_ids, runs.top_logprobs)
    if not features.logprobs or parts[0] is None:
        return [[(t, None, None, None) for t in row] for row in tokens]
    logprob, top_ids, top_lp = (p.tolist() for p in parts)
    if runs is None:
        logprob, top_ids, top_lp = ([[x] for x in p] for p in (logprob, top_ids, top_lp))
    return [[(t, logprob[s][i], top_ids[s][i], top_lp[s][i]) for i, t in enumerate(row)]
            for s, row in enumerate(tokens)]


def _scored(prompt: PromptScores, resident: Mapping[int, Asked]) -> dict[int, list[TokenLogprob]]:
    n = int(prompt.count.sum())
    slots, tokens, logprobs = (x[:n].tolist() for x in (prompt.slot, prompt.token, prompt.logprob))
    top_ids, top_logprobs = prompt.top_ids[:n].tolist(), prompt.top_logprobs[:n].tolist()
    scored: dict[int, list[TokenLogprob]] = {}
    for i, slot in enumerate(slots):
        k = resident[slot].prompt_logprobs
        scored.setdefault(slot, []).append(TokenLogprob(tokens[i], logprobs[i], list(zip(top_ids[i][:k],
                                                                                  top_logprobs[i][:k], strict=True))))
    return scored


@dataclass(frozen=True)
class StepInputs:
    """What rank 0 sends the other ranks before each host step: the records it admitted and the windows."""

    now: float  # rank 0's clock at admission: the TTFT deadlines count from it
    admitted: list[int]  # slots admitted, in table order (an invalid record is dropped by every rank alike)
    records: np.ndarray  # their records, in that order
    windows: Windows


IDLE_BACKOFF_S = (0.0002, 0.005)  # an idle loop naps this long, doubling: wakes within ~5 ms


class HostDriver:
    """The `host` drive mode over the slot table (a Driver)."""

    mode = "host"
    limitations = ()

    def __init__(self, engine: Engine, table: SlotTable, ranks: Ranks | None = None):
        """ranks: the other ranks, with tensor parallelism: each step's inputs go to them."""
        engine.check_geometry(table.geometry)
        self.engine, self.table, self.ranks = engine, table, ranks
        self.epoch = int(table.header["epoch"])
        self.rank = HostRank(engine)
        self.mirror = self.rank.mirror
        self.max_running: int | None = None  # admission limit set over the control plane
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def resident(self) -> int:
        return len(self.rank.asked)

    def progress(self) -> int:
        """Steps, and the sublayers run within them: a CPU prefill of seconds is alive while its layers go by."""
        return int(self.table.header["steps"]) + self.engine.model.sublayers_run

    def idle(self) -> bool:
        return self.resident == 0 and not self.table.submitted().size  # (this loop stamps the heartbeat itself)

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
        if self.engine.device.type == "cuda":  # a new thread's current device is 0, where Triton would launch
            torch.cuda.set_device(self.engine.device)
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
        now = time.monotonic()
        admitted = self._admit(now)
        if not self.rank.asked:
            return False
        slots = np.fromiter(self.rank.asked, dtype=np.int64)
        table = self.table.slots  # field by field: whole records would copy prompts and windows each step
        room = window_room(table["produced"][slots].astype(np.int64), table["consumed"][slots].astype(np.int64),
                           self.table.geometry.window)
        windows = Windows(slots, table["cancel"][slots] != 0, room)
        if self.ranks is not None:
            self.ranks.send(StepInputs(now, admitted, table[admitted], windows))
        events = self.rank.step(windows)
        self.check_epoch()
        for slot, event in events.items():
            self._publish(slot, event)
        self.table.heartbeat()
        return self.rank.ran

    def check_epoch(self) -> None:
        if int(self.table.header["epoch"]) != self.epoch:
            raise Fenced(f"the slot table is in epoch {int(self.table.header['epoch'])}, this engine's was "
                         f"{self.epoch}")

    def _admit(self, now: float) -> list[int]:
        """Admits what the ingress submitted (up to the admission limit); returns those slots."""
        submitted = self.table.submitted().tolist()
        if self.max_running is not None:
            submitted = submitted[:max(0, self.max_running - self.resident)]  # the rest wait, SUBMITTED
        # A slot whose grammar still compiles waits, SUBMITTED; one whose grammar cannot be served is ended.
        submitted, failed = self.rank.grammars.ready(self.table.slots, submitted)
        invalid = self.rank.admit(self.table.slots, submitted, now) if submitted else []
        for slot in submitted + failed:
            self.table.admit(slot)
            if slot in invalid or slot in failed:  # the ingress validates; a record that still fails is ended
                self.table.finish(slot, Finish.ABORT)
        return submitted

    def _publish(self, slot: int, event: SlotEvent) -> None:
        for p in event.prompt:  # ahead of the token: the reader counts prompt_len - 1 of them first
            self.table.emit(slot, p.token_id, p.logprob, [t for t, _ in p.top], [lp for _, lp in p.top])
        for s in event.tokens:  # several with drafts accepted: the plan kept them within the window's room
            self.table.emit(slot, s.token, s.logprob or 0.0, [t for t, _ in s.top], [lp for _, lp in s.top])
        if event.finish_reason:
            self.table.finish(slot, _FINISH[event.finish_reason], event.stats)


_FINISH = {name: reason for reason, name in FINISH_NAMES.items()}
