"""The `zmq` transport's client: the ingress's client interface (blink.ingress.client) over ZeroMQ to the engine
host's relay, for an ingress that cannot map the slot table (another host, or no NIC path).

The relay is probed for the engine's health every few hundred milliseconds; when it stays silent past the
deadline, every request in flight ends with Finish.FAILED (the ingress turns that into an error event), as
when an engine dies under `shm`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator

import structlog
import zmq
import zmq.asyncio

from blink.ingress.client import EngineHealth, IngressClient, Overloaded, Stream, stream_outputs
from blink.ingress.errors import APIError, engine_unreachable
from blink.shared import relay_protocol as wire
from blink.shared import sockets
from blink.shared.control import EngineInfo
from blink.shared.settings import Settings
from blink.shared.slot_table import EngineState, Finish, Output, Request

log = structlog.get_logger()
PROBE_S = 0.2


class RemoteSlotClient:
    transport = "zmq"

    def __init__(self, endpoint: str, keys: sockets.Keys, num_slots: int, max_waiting: int, deadline_s: float):
        self.endpoint, self.num_slots, self.max_waiting, self.deadline_s = endpoint, num_slots, max_waiting, deadline_s
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)  # the same name after a reconnect
        sockets.connect(self.sock, endpoint, keys)
        self._streams: dict[str, Stream] = {}
        self._accepted: dict[str, asyncio.Future[int]] = {}
        self._health = EngineHealth("unreachable", math.inf, 0, 0)
        self._heard_at = -math.inf
        self._relay: str | None = None  # the relay's life, from its health answers
        self._relay_of: dict[str, str] = {}  # request id -> the relay life that accepted it
        self._adopted = asyncio.Event()  # submissions wait until a pending adoption was sent (a switch)
        self._adopted.set()
        self._tasks: list[asyncio.Task] = []
        self.failed_over = 0
        self.transport_lost: str | None = None  # never set: the relay is the path of last resort (SlotClient's)

    @property
    def running(self) -> int:
        return len(self._streams) - len(self._accepted)

    @property
    def waiting(self) -> int:
        return len(self._accepted)

    def replaced(self) -> bool:
        """Never: the relay lives in the engine, so a new engine's relay serves its own table (SlotClient.replaced)."""
        return False

    def end_all(self) -> None:
        """Nothing to end: never replaced()."""

    def health(self) -> EngineHealth:
        if time.monotonic() - self._heard_at > self.deadline_s:
            return EngineHealth("unreachable", math.inf, self._health.epoch, self._health.failovers)
        return self._health

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive()), loop.create_task(self._probe())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.close()

    def close(self) -> None:
        """Nothing left: the table is the engine host's."""

    async def submit(self, request: Request) -> Stream:
        if self.health().state == "unreachable":
            raise engine_unreachable()
        if len(self._accepted) >= self.max_waiting + self.num_slots:
            raise Overloaded
        await self._adopted.wait()  # the relay must adopt the switched requests before it claims the table
        rid = uuid.uuid4().hex
        stream = Stream(-1, asyncio.Queue(), request_id=rid, owner=self)
        self._streams[rid] = stream  # before sending: outputs may follow the acceptance at once
        accepted = self._accepted[rid] = asyncio.get_running_loop().create_future()
        try:
            await self.sock.send(wire.encode({"op": "submit", "id": rid, "request": wire.request_to_wire(request)}))
            stream.slot = await accepted
        except BaseException:
            self._streams.pop(rid, None)
            if not accepted.done():
                await self._send_cancel(rid)
            raise
        finally:
            self._accepted.pop(rid, None)
        return stream

    def outputs(self, stream: Stream) -> AsyncIterator[Output]:
        return stream_outputs(stream)

    async def abandon(self, stream: Stream) -> None:
        self._relay_of.pop(stream.request_id, None)
        if self._streams.pop(stream.request_id, None) is not None:
            await self._send_cancel(stream.request_id)

    async def hand_over(self, to: IngressClient) -> dict[int, Stream]:
        raise NotImplementedError("the relay is the path of last resort: no switch leaves it")

    async def take_over(self, old: IngressClient) -> int:
        """Takes over the requests a table client published (a switch of transport): the relay reads their slots on
        from what was consumed, and their outputs go on into the same queues."""
        self._adopted.clear()  # new requests wait until the relay has adopted the ones in flight
        streams = await old.hand_over(self)
        names = {}
        for slot, stream in streams.items():
            stream.request_id, stream.owner = uuid.uuid4().hex, self
            self._streams[stream.request_id] = stream
            self._relay_of[stream.request_id] = self._relay
            names[stream.request_id] = slot
        try:
            await self.sock.send(wire.encode({"op": "adopt", "streams": names}))
        finally:
            self._adopted.set()
        return len(names)

    async def _send_cancel(self, rid: str) -> None:
        await self._send_or_drop({"op": "cancel", "id": rid})

    async def _send_or_drop(self, message: dict) -> None:
        """Never waits: with the relay away, a full queue must not stall the probe that notices it."""
        with contextlib.suppress(zmq.ZMQError):
            await self.sock.send(wire.encode(message), flags=zmq.NOBLOCK)

    async def _receive(self) -> None:
        while True:
            try:
                message = wire.decode(await self.sock.recv())
            except ValueError as e:
                log.warning("bad frame from the relay", error=str(e))
                continue
            if "health" in message:
                h = message["health"]
                self._health = EngineHealth(EngineState(h["state"]).name.lower(), h["heartbeat_age_s"], h["epoch"],
                                            h["failovers"], h.get("admission_limit"))
                self._heard_at = time.monotonic()
                if h["relay"] != self._relay:
                    self._relay = h["relay"]
                    await self._fail([rid for rid, life in self._relay_of.items() if life != self._relay])
                continue
            rid = message.get("id")
            if (accepted := self._accepted.get(rid)) is not None and not accepted.done():
                if "error" in message:
                    accepted.set_exception(Overloaded() if message["error"] == "overloaded" else
                                           relay_refused(message["error"]))
                else:
                    self._relay_of[rid] = message["relay"]
                    accepted.set_result(message["slot"])
            if "out" in message and (stream := self._streams.get(rid)) is not None:
                if stream.admitted_at is None:
                    stream.admitted_at = time.monotonic()
                out = wire.output_from_wire(message["out"])
                stream.queue.put_nowait(out)
                if out.finish != Finish.NONE:
                    self._streams.pop(rid, None)
                    self._relay_of.pop(rid, None)

    async def _probe(self) -> None:
        """Asks for the engine's health; ends every request in flight once the relay went silent."""
        while True:
            await self._send_or_drop({"op": "health"})
            await asyncio.sleep(PROBE_S)
            if self._streams and time.monotonic() - self._heard_at > self.deadline_s:
                log.warning("relay silent: failing the requests in flight", count=len(self._streams))
                await self._fail(list(self._streams))

    async def _fail(self, rids: list[str]) -> None:
        """Ends these requests with Finish.FAILED: the relay (and engine) that held them is gone or silent."""
        for rid in rids:
            self._relay_of.pop(rid, None)
            accepted = self._accepted.get(rid)
            if accepted is not None and not accepted.done():
                accepted.set_exception(engine_unreachable())
            if (stream := self._streams.pop(rid, None)) is not None:
                stream.queue.put_nowait(Output([], [], [], [], Finish.FAILED))
                self.failed_over += 1
                await self._send_cancel(rid)  # a relay that was only slow would go on generating for nobody


def connect(settings: Settings, keys: sockets.Keys, info: EngineInfo) -> RemoteSlotClient:
    """The `zmq` transport: always a path, through the engine host's relay (degraded)."""
    return RemoteSlotClient(settings.relay_endpoint, keys, info.num_slots, settings.max_waiting,
                            settings.watchdog_deadline)


def relay_refused(reason: str) -> APIError:
    """The relay could not publish (its table fed by another transport, say): a 503 saying why, not a 500."""
    return APIError(503, f"the engine host's relay refused the request: {reason[:300]}", "service_unavailable",
                    code="relay_refused", headers={"Retry-After": "1"})
