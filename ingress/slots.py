"""The ingress's side of the slot table: take a free slot, publish a request, stream its outputs back.

One poller task reads every busy slot's output window and hands the records to that request's queue; a
request whose reader falls behind is not read further, so its window fills and the engine pauses it.

Failover: when the table's epoch moves on (a watchdog declared the engine dead, or a new engine took the table
over), a request no engine admitted yet is resubmitted to the new epoch, and one the dead engine held ends with
Finish.FAILED after the tokens it did produce. Slots a dead ingress left behind are cancelled and reclaimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import structlog

from blink.ingress.errors import engine_unreachable
from blink.shared.remote_memory import TransportLost
from blink.shared.service_class import ServiceClass
from blink.shared.slot_table import Client, EngineState, Finish, Output, Request, SlotState, SlotTable

log = structlog.get_logger()
POLL_MIN_S, POLL_MAX_S = 0.0002, 0.002
RELINK_S = 0.2  # between attempts to restore a lost path to the table


class Overloaded(Exception):
    """Every slot is busy and the waiting line is full."""


@dataclass
class Stream:
    slot: int
    queue: asyncio.Queue[Output]
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    abandoned: bool = False  # the consumer went away: outputs are dropped until the engine aborts it
    request_id: str | None = None  # the zmq transport's name for it at the relay
    owner: Transport | None = None  # the transport that feeds its queue now (it changes on a switch)


class Transport(Protocol):
    async def abandon(self, stream: Stream) -> None: ...


class _Unreachable:
    """Where a client whose table no engine serves sends what is submitted to it: a 503."""

    async def submit(self, request: Request) -> Stream:
        raise engine_unreachable()


class Rerouted(Exception):
    """The transport was switched while this request waited for a slot: submit it to `to`."""

    def __init__(self, to):
        super().__init__("rerouted")
        self.to = to


async def stream_outputs(stream: Stream) -> AsyncIterator[Output]:
    """Yields the stream's records until its finish; a consumer that leaves first cancels the request, through
    whichever transport feeds the stream by then."""
    finished = False
    try:
        while not finished:
            out = await stream.queue.get()
            finished = out.finish != Finish.NONE
            yield out
    finally:
        if not finished and stream.owner is not None:
            await stream.owner.abandon(stream)


@dataclass(frozen=True)
class EngineHealth:
    """What /ready and /metrics say of the engine, whichever transport reaches it."""

    state: str  # starting, ready, draining, stopped; unreachable when the transport lost it
    heartbeat_age_s: float
    epoch: int
    failovers: int
    admission_limit: int | None = None  # the control plane's cap on requests admitted at once; None: none


class SlotClient:
    """The `shm` transport: this process maps the table and publishes into it; the `rdma` transport: the same,
    into a replica whose writes and reads go over the NIC (blink.shared.replica_table)."""

    def __init__(self, table: SlotTable, max_waiting: int, client: Client = Client.INGRESS,
                 adopting: frozenset[int] = frozenset(), reserved_slots: int = 0, by_class: bool = True,
                 relink: Callable[[], None] | None = None):
        """by_class: latency-sensitive requests wait in a line of their own, served first; reserved_slots: free
        slots only they may take, so that one arriving while best-effort work fills the table reaches the engine,
        which preempts at the next step. relink: reconnects a replica table whose path was lost (rdma)."""
        table.claim(client)
        self.table, self._client = table, client
        self.max_waiting = max_waiting
        self.num_slots = table.geometry.num_slots
        self.reserved_slots = min(reserved_slots, self.num_slots - 1) if by_class else 0
        self.by_class = by_class
        # Waiting for a slot, per class: latency-sensitive ones are served first.
        self._waiters: dict[ServiceClass, deque[asyncio.Future[int]]] = {c: deque() for c in ServiceClass}
        self._busy: dict[int, Stream] = {}
        self._free: deque[int] = deque()
        self._orphans: set[int] = set()  # slots a previous ingress left busy: cancelled, freed once ended
        self._resync(adopting)
        self._relink = relink
        self.transport_lost: str | None = None  # why, while the path to the table is being restored
        self.failed_over = 0  # requests ended because their engine died
        self._handed_to: Transport | None = None  # set by a switch of transport
        self._epoch_seen = int(table.header["epoch"])  # a change sends the poller through _fail_over
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def transport(self) -> str:
        return self.table.transport

    @property
    def running(self) -> int:
        return len(self._busy)

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    def _resync(self, keep: frozenset[int] | set[int]) -> None:
        """Sorts every slot by the table: free ones are ours to hand out; busy ones not in `keep` belong to nobody
        here (a previous ingress, or a publish whose reply was lost), so they are cancelled and reclaimed."""
        self._free.clear()
        for slot in range(self.table.geometry.num_slots):
            if self.table.slots[slot]["state"] == SlotState.FREE:
                self._free.append(slot)
            elif slot not in keep:
                self._orphans.add(slot)
                self.table.cancel(slot)

    def health(self) -> EngineHealth:
        try:
            self.table.refresh_header()
        except TransportLost:
            return EngineHealth("unreachable", math.inf, self._epoch_seen, 0)
        h = self.table.header
        return EngineHealth(EngineState(int(h["engine_state"])).name.lower(), self.table.heartbeat_age_s(),
                            int(h["epoch"]), int(h["failovers"]), self.table.admission_limit())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        with contextlib.suppress(TransportLost):  # the relay then takes the table over regardless
            self.table.release_client(self._client)

    async def submit(self, request: Request) -> Stream:
        if self._handed_to is not None:  # a handler that took this client before a switch
            return await self._handed_to.submit(request)
        arrived = time.monotonic()
        try:
            slot = await self._acquire(ServiceClass(request.service_class) if self.by_class
                                       else ServiceClass.LATENCY_SENSITIVE)
        except Rerouted as e:
            return await e.to.submit(request)
        if self._handed_to is not None:  # got a slot as the switch began: the table is the relay's now
            return await self._handed_to.submit(request)
        # The engine learns what remains of the TTFT SLO after the wait for a slot.
        waited_ms = (time.monotonic() - arrived) * 1000
        try:
            self.table.publish(slot, dataclasses.replace(request, ttft_slo_ms=request.ttft_slo_ms - waited_ms))
        except TransportLost:
            self._wake.set()  # the poller notices and restores the path; the slot is sorted out then
            raise engine_unreachable() from None
        except Exception:
            self._release(slot)
            raise
        stream = Stream(slot, asyncio.Queue(), submitted_at=arrived, owner=self)
        self._busy[slot] = stream
        self._wake.set()
        return stream

    def outputs(self, stream: Stream) -> AsyncIterator[Output]:
        return stream_outputs(stream)

    async def abandon(self, stream: Stream) -> None:
        if self._busy.get(stream.slot) is stream:  # the slot may already be someone else's
            stream.abandoned = True
            with contextlib.suppress(TransportLost):  # cancelled again when the path is back
                self.table.cancel(stream.slot)

    def adopt(self, slot: int) -> Stream:
        """Takes over a request another client published (a transport switch): its outputs from `consumed` on."""
        stream = Stream(slot, asyncio.Queue(), owner=self)
        self._busy[slot] = stream
        self._epoch_seen = -1  # it may come from an epoch that ended before this client saw it
        self._wake.set()
        return stream

    async def hand_over(self, to: Transport) -> dict[int, Stream]:
        """Stops this client for a switch of transport: returns the requests in flight by slot, sends the ones
        waiting for a slot to `to`, and gives up the table's claim."""
        self._handed_to = to
        await self.stop()
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(Rerouted(to))
            waiters.clear()
        busy, self._busy = self._busy, {}
        return busy

    async def _acquire(self, service_class: ServiceClass) -> int:
        if len(self._free) > (0 if service_class == ServiceClass.LATENCY_SENSITIVE else self.reserved_slots):
            return self._free.popleft()
        if self.waiting >= self.max_waiting:
            best_effort = self._waiters[ServiceClass.BEST_EFFORT]
            # The newest best-effort waiter gives way; one cancelled but not yet gone from the line cannot.
            newest = next((w for w in reversed(best_effort) if not w.done()), None)
            if service_class != ServiceClass.LATENCY_SENSITIVE or newest is None:
                raise Overloaded
            best_effort.remove(newest)
            newest.set_exception(Overloaded())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[service_class].append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())
            elif waiter in self._waiters[service_class]:
                self._waiters[service_class].remove(waiter)
            raise

    def _release(self, slot: int) -> None:
        for service_class, waiters in self._waiters.items():
            if service_class == ServiceClass.BEST_EFFORT and len(self._free) < self.reserved_slots:
                break  # this slot refills the latency-sensitive reserve
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(slot)
                    return
        self._free.append(slot)

    async def _poll(self) -> None:
        """Runs for the ingress's life: a failed pass is logged and the next one tries again."""
        while True:
            try:
                await self._poll_forever()
            except asyncio.CancelledError:
                raise
            except TransportLost as e:
                await self._restore(e)
            except Exception:
                log.exception("slot poller failed; restarting it")
                await asyncio.sleep(POLL_MAX_S)

    async def _poll_forever(self) -> None:
        # Field views, gathered per poll: indexing whole records would copy their prompts and windows.
        slots = self.table.slots
        state_of, produced, consumed = slots["state"], slots["produced"], slots["consumed"]
        finished, submitted = int(SlotState.FINISHED), int(SlotState.SUBMITTED)  # plain ints: enums are slow here
        pause = POLL_MIN_S
        while True:
            if not self._busy and not self._orphans:
                self._wake.clear()
                await self._wake.wait()
            busy = np.fromiter(self._busy, dtype=np.int64)
            # A replica (rdma) pulls what the engine wrote; under shm the table is the engine's memory.
            self.table.refresh([*busy.tolist(), *self._orphans])
            if self._orphans:
                self._reclaim_orphans()
            if (epoch := int(self.table.header["epoch"])) != self._epoch_seen:  # a scalar read per pass
                self._fail_over()
                self._epoch_seen = epoch
                busy = np.fromiter(self._busy, dtype=np.int64)
            states = state_of[busy]
            news = (produced[busy] != consumed[busy]) | (states == finished)
            now = time.monotonic()
            # Poll fast while outputs flow, back off while the engine is busy computing.
            pause = POLL_MIN_S if news.any() else min(POLL_MAX_S, pause * 2)
            for slot, admitted in zip(busy[news].tolist(), (states[news] != submitted).tolist(), strict=True):
                stream = self._busy[slot]
                if admitted and stream.admitted_at is None:
                    stream.admitted_at = now
                if stream.queue.qsize() > self.table.geometry.window and not stream.abandoned:
                    continue  # the reader is behind: leave the window full so the engine pauses
                out = self.table.read(slot)
                if not stream.abandoned:
                    stream.queue.put_nowait(out)
                if out.finish != Finish.NONE:
                    del self._busy[slot]
                    self.table.free(slot)
                    self._release(slot)
            await asyncio.sleep(pause)

    async def _restore(self, error: TransportLost) -> None:
        """Reconnects until the path is back (the watchdog meanwhile may switch the deployment to `zmq`, which
        adopts the requests in flight); then resumes, ending what a restarted engine no longer holds."""
        if self._relink is None:
            raise error
        self.transport_lost = str(error)
        log.warning("path to the slot table lost; reconnecting", reason=str(error))
        while self._handed_to is None:
            try:
                await asyncio.to_thread(self._relink)
            except (TransportLost, RuntimeError, TimeoutError) as e:
                self.transport_lost = str(e)
                await asyncio.sleep(RELINK_S)
                continue
            self._resync(set(self._busy))
            for slot, stream in self._busy.items():
                if stream.abandoned:
                    self.table.cancel(slot)
            for _ in range(len(self._free)):  # each free slot once: one kept for the reserve goes back to the end
                self._release(self._free.popleft())
            log.info("path to the slot table restored", epoch=int(self.table.header["epoch"]))
            self.transport_lost = None
            return

    def _fail_over(self) -> None:
        """Resubmits what the dead engine never admitted; ends what it held, after the tokens it produced."""
        for slot, stream in list(self._busy.items()):
            if not self.table.orphaned(slot):
                continue
            if self.table.slots[slot]["state"] == SlotState.SUBMITTED:
                self.table.resubmit(slot)
                continue
            self._fail(slot, stream)
            self.table.reclaim(slot)
            self._release(slot)

    def _fail(self, slot: int, stream: Stream) -> None:
        """Ends a request with Finish.FAILED after the tokens it did produce."""
        out = self.table.read(slot)
        stream.queue.put_nowait(Output(out.tokens, out.logprobs, out.top_ids, out.top_logprobs, Finish.FAILED))
        del self._busy[slot]
        self.failed_over += 1
        log.warning("request failed with its engine", slot=slot, epoch=int(self.table.header["epoch"]))

    def replaced(self) -> bool:
        """Whether the engine now serves another table than this client's (blink.shared.slot_table.replaced)."""
        return self.table.replaced()

    def end_all(self) -> None:
        """Ends every request with its engine, for a client whose table no engine serves any more (replaced): the
        ones in slots fail after what they produced, the waiting ones and any later one get a 503."""
        self._handed_to = _Unreachable()
        for slot, stream in list(self._busy.items()):
            self._fail(slot, stream)
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(engine_unreachable())
            waiters.clear()

    def _reclaim_orphans(self) -> None:
        for slot in list(self._orphans):
            state = self.table.slots[slot]["state"]
            if state == SlotState.FINISHED:
                self.table.free(slot)
            elif self.table.orphaned(slot):
                self.table.reclaim(slot)
            elif state != SlotState.FREE:
                continue
            self._orphans.discard(slot)
            self._release(slot)
