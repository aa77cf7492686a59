"""The `shm` and `rdma` transports' client: publishes requests into the slot table and streams their outputs back.

Its parts do its jobs: SlotPool hands out free slots, Poller reads the busy ones' outputs, Failover keeps requests
whole when the engine, the path to the table or the transport changes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable

from blink.ingress.client import EngineHealth, IngressClient, NoPath, Stream, stream_outputs
from blink.ingress.errors import engine_unreachable
from blink.ingress.failover import Failover, Rerouted
from blink.ingress.poller import Poller
from blink.ingress.slot_pool import SlotPool
from blink.shared import sockets
from blink.shared.control import EngineInfo
from blink.shared.remote_memory import TransportLost
from blink.shared.service_class import ServiceClass
from blink.shared.settings import Settings
from blink.shared.slot_table import Client, EngineState, Output, Request, SlotTable


class SlotClient:
    """This process maps the table and publishes into it (`shm`), or into a replica whose writes and reads go over
    the NIC (`rdma`: blink.shared.replica_table). The relay runs one too, for the `zmq` transport's ingress."""

    def __init__(self, table: SlotTable, max_waiting: int, client: Client = Client.INGRESS,
                 adopting: frozenset[int] = frozenset(), reserved_slots: int = 0, by_class: bool = True,
                 relink: Callable[[], None] | None = None):
        """by_class: latency-sensitive requests wait in a line of their own, served first, and may take the
        reserved_slots; adopting: busy slots whose requests adopt() will take over; relink: reconnects a replica
        table whose path was lost (rdma)."""
        table.claim(client)
        self.table, self._client = table, client
        self.max_waiting = max_waiting
        self.num_slots = table.geometry.num_slots
        self.by_class = by_class
        self.pool = SlotPool(self.num_slots, max_waiting, reserved_slots if by_class else 0)
        self.busy: dict[int, Stream] = {}  # requests in slots, by slot: Poller and Failover share it (never rebound)
        self.failover = Failover(table, self.pool, self.busy, relink)
        self.failover.resync(adopting)
        self.poller = Poller(table, self.pool, self.busy, self.failover)
        self._task: asyncio.Task | None = None

    @property
    def transport(self) -> str:
        return self.table.transport

    @property
    def running(self) -> int:
        return len(self.busy)

    @property
    def waiting(self) -> int:
        return self.pool.waiting

    @property
    def failed_over(self) -> int:
        return self.failover.failed_over

    @property
    def transport_lost(self) -> str | None:
        return self.failover.transport_lost

    def health(self) -> EngineHealth:
        try:
            self.table.refresh_header()
        except TransportLost:
            return EngineHealth("unreachable", math.inf, self.failover.epoch_seen, 0)
        h = self.table.header
        return EngineHealth(EngineState(int(h["engine_state"])).name.lower(), self.table.heartbeat_age_s(),
                            int(h["epoch"]), int(h["failovers"]), self.table.admission_limit())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.poller.run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        with contextlib.suppress(TransportLost):  # the relay then takes the table over regardless
            self.table.release_client(self._client)

    def close(self) -> None:
        self.table.remove_if_abandoned()  # when the engine stopped first

    async def submit(self, request: Request) -> Stream:
        if self.failover.handed_to is not None:  # a handler that took this client before a switch
            return await self.failover.handed_to.submit(request)
        arrived = time.monotonic()
        try:
            slot = await self.pool.acquire(ServiceClass(request.service_class) if self.by_class
                                           else ServiceClass.LATENCY_SENSITIVE)
        except Rerouted as e:
            return await e.to.submit(request)
        if self.failover.handed_to is not None:  # got a slot as the switch began: the table is the relay's now
            return await self.failover.handed_to.submit(request)
        # The engine learns what remains of the TTFT SLO after the wait for a slot.
        waited_ms = (time.monotonic() - arrived) * 1000
        try:
            self.table.publish(slot, dataclasses.replace(request, ttft_slo_ms=request.ttft_slo_ms - waited_ms))
        except TransportLost:
            self.poller.wake.set()  # the poller notices and restores the path; the slot is sorted out then
            raise engine_unreachable() from None
        except Exception:
            self.pool.release(slot)
            raise
        stream = Stream(slot, asyncio.Queue(), submitted_at=arrived, owner=self)
        self.busy[slot] = stream
        self.poller.wake.set()
        return stream

    def outputs(self, stream: Stream) -> AsyncIterator[Output]:
        return stream_outputs(stream)

    async def abandon(self, stream: Stream) -> None:
        if self.busy.get(stream.slot) is stream:  # the slot may already be someone else's
            stream.abandoned = True
            with contextlib.suppress(TransportLost):  # cancelled again when the path is back
                self.table.cancel(stream.slot)

    def adopt(self, slot: int) -> Stream:
        """Takes over a request another client published (the relay, after a switch): its outputs from `consumed`
        on."""
        stream = Stream(slot, asyncio.Queue(), owner=self)
        self.busy[slot] = stream
        self.failover.epoch_seen = -1  # it may come from an epoch that ended before this client saw it
        self.poller.wake.set()
        return stream

    def replaced(self) -> bool:
        """Whether the engine now serves another table than this client's (blink.shared.slot_table.replaced)."""
        return self.table.replaced()

    def end_all(self) -> None:
        self.failover.end_all()

    async def hand_over(self, to: IngressClient) -> dict[int, Stream]:
        """Stops this client for a switch of transport: returns the requests in flight by slot, sends the ones
        waiting for a slot to `to`, and gives up the table's claim."""
        await self.stop()
        return self.failover.hand_over(to)

    async def take_over(self, old: IngressClient) -> int:
        raise NotImplementedError("a switch goes to the relay (zmq), the path of last resort")


def table_client(table: SlotTable, settings: Settings, info: EngineInfo,
                 relink: Callable[[], None] | None = None) -> SlotClient:
    """The ingress's client on `table`, with the deployment's line and reserve."""
    return SlotClient(table, settings.max_waiting, reserved_slots=settings.reserved_slots(info.num_slots),
                      by_class=settings.by_class, relink=relink)


def connect(settings: Settings, keys: sockets.Keys, info: EngineInfo) -> SlotClient:
    """The `shm` transport: the engine's table, mapped where this host has it (not when the relay feeds it)."""
    try:
        return table_client(SlotTable.attach(info.slot_table), settings, info)
    except (FileNotFoundError, RuntimeError) as e:
        raise NoPath(str(e)) from e
