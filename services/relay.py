"""The engine host's relay for the `zmq` transport: an ingress without the slot table in its memory (another
host, or no NIC path) sends requests here, and the relay publishes them into the table and streams the outputs
back. It runs as a thread of the engine service with its own event loop and the same SlotClient an ingress
uses, so admission, back-pressure and failover behave as with `shm`.

It claims the table (as its one publisher) at the first request, not before, so that a local `shm` ingress
keeps working when nobody uses the relay.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import structlog
import zmq
import zmq.asyncio

from blink.ingress.client import Overloaded
from blink.ingress.slots import SlotClient
from blink.shared import relay_protocol as wire
from blink.shared import sockets
from blink.shared.slot_table import Client, SlotTable

log = structlog.get_logger()


class Relay:
    def __init__(self, table: SlotTable, endpoint: str, keys: sockets.Keys, max_waiting: int, reserved_slots: int = 0,
                 by_class: bool = True):
        """endpoint: what to bind; keys: the deployment's (only its members' frames get through)."""
        self.table, self.endpoint, self.keys, self.max_waiting = table, endpoint, keys, max_waiting
        self.reserved_slots, self.by_class = reserved_slots, by_class
        self.client: SlotClient | None = None
        self.instance = uuid.uuid4().hex  # a remote ingress fails what a previous relay (engine) accepted
        self._tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self._stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=lambda: asyncio.run(self._serve()), name="relay", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()  # the loop looks at it every 100 ms

    async def _serve(self) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished ingress raises, not vanishes
        # A submit frame holds a whole prompt: room for the longest the table takes, as JSON.
        sockets.bind(self.sock, self.endpoint, self.keys,
                     max_frame_bytes=sockets.CONTROL_FRAME_BYTES + 16 * self.table.geometry.max_prompt_tokens)
        log.info("relay listening", endpoint=self.endpoint)
        try:
            while not self._stopped.is_set():
                if not await self.sock.poll(100):
                    continue
                identity, frame = await self.sock.recv_multipart()
                try:
                    await self._handle(identity, wire.decode(frame))
                except Exception as e:  # one bad frame must not end the relay for every remote ingress
                    log.warning("relay frame refused", error=f"{type(e).__name__}: {e}")
        finally:
            for task in self._tasks.values():
                task.cancel()
            if self.client is not None:
                await self.client.stop()
            self.sock.close()
            sockets.unlink_ipc(self.endpoint)

    async def _handle(self, identity: bytes, message: dict) -> None:
        op = message["op"]
        if op == "health":
            h = self.table.header
            age_s = (time.monotonic_ns() - int(h["last_step_ns"])) / 1e9
            await self._send(identity, {"health": {"state": int(h["engine_state"]), "heartbeat_age_s": age_s,
                                                   "epoch": int(h["epoch"]), "failovers": int(h["failovers"]),
                                                   "admission_limit": self.table.admission_limit(),
                                                   "relay": self.instance}})
        elif op == "submit":
            key = (identity, str(message["id"]))
            self._track(key, self._run(key, wire.request_from_wire(message["request"])))
        elif op == "adopt":
            streams = {str(rid): int(slot) for rid, slot in message["streams"].items()}
            # The ingress handing its requests over may not have been able to release the table (a lost NIC path).
            self.table.claim(Client.RELAY, force=True)
            if self.client is None:
                self.client = SlotClient(self.table, self.max_waiting, Client.RELAY, frozenset(streams.values()),
                                         self.reserved_slots, self.by_class)
                self.client.start()
            for rid, slot in streams.items():
                key = (identity, rid)
                self._track(key, self._forward(key, self.client.adopt(slot)))
            log.info("relay adopted requests", count=len(streams))
        elif op == "cancel":
            task = self._tasks.pop((identity, str(message["id"])), None)
            if task is not None:
                task.cancel()
        else:
            raise ValueError(f"unknown op {op!r}")

    async def _run(self, key: tuple[bytes, str], request) -> None:
        identity, rid = key
        try:
            if self.client is None:
                self.client = SlotClient(self.table, self.max_waiting, Client.RELAY, reserved_slots=self.reserved_slots,
                                         by_class=self.by_class)
                self.client.start()
            stream = await self.client.submit(request)
        except Overloaded:
            await self._send(identity, {"id": rid, "error": "overloaded"})
            return
        except (RuntimeError, ValueError) as e:
            await self._send(identity, {"id": rid, "error": str(e)})
            return
        if await self._send(identity, {"id": rid, "slot": stream.slot, "relay": self.instance}):
            await self._forward(key, stream)
        else:
            await self.client.abandon(stream)

    async def _forward(self, key: tuple[bytes, str], stream) -> None:
        identity, rid = key
        async for out in self.client.outputs(stream):
            if not await self._send(identity, {"id": rid, "out": wire.output_to_wire(out)}):
                break  # leaving outputs() cancels the slot's request

    def _track(self, key: tuple[bytes, str], work) -> None:
        task = self._tasks[key] = asyncio.create_task(work)
        task.add_done_callback(lambda _: self._tasks.pop(key, None) if self._tasks.get(key) is task else None)

    async def _send(self, identity: bytes, message: dict) -> bool:
        """False when the ingress is gone (ROUTER_MANDATORY refuses the frame)."""
        try:
            await self.sock.send_multipart([identity, wire.encode(message)])
        except zmq.ZMQError:
            log.info("relay client gone", request_id=message.get("id"))
            return False
        return True
