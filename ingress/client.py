"""The ingress's client interface: what the app, the generator, the ingress state and its control socket use of a
transport (shm and rdma: blink.ingress.slots.SlotClient; zmq: blink.ingress.remote_slots.RemoteSlotClient)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from blink.shared.slot_table import Finish, Output, Request


class Overloaded(Exception):
    """Every slot is busy and the waiting line is full."""


class NoPath(Exception):
    """This transport has no path to the engine from here: the ingress tries the next one (blink.ingress.connect)."""


@dataclass
class Stream:
    """One request's outputs, as the client that feeds them hands them over."""

    slot: int
    queue: asyncio.Queue[Output]
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    abandoned: bool = False  # the consumer went away: outputs are dropped until the engine aborts it
    request_id: str | None = None  # the zmq transport's name for it at the relay
    owner: IngressClient | None = None  # the client that feeds its queue now (it changes on a switch)


@dataclass(frozen=True)
class EngineHealth:
    """What /ready and /metrics say of the engine, whichever transport reaches it."""

    state: str  # starting, ready, draining, stopped; unreachable when the transport lost it
    heartbeat_age_s: float
    epoch: int
    failovers: int
    admission_limit: int | None = None  # the control plane's cap on requests admitted at once; None: none


async def stream_outputs(stream: Stream) -> AsyncIterator[Output]:
    """Yields the stream's records until its finish; a consumer that leaves first cancels the request, through
    whichever client feeds the stream by then."""
    finished = False
    try:
        while not finished:
            out = await stream.queue.get()
            finished = out.finish != Finish.NONE
            yield out
    finally:
        if not finished and stream.owner is not None:
            await stream.owner.abandon(stream)


class IngressClient(Protocol):
    """A transport's client: publishes requests to the engine and streams their outputs back."""

    transport: str  # its name in blink.shared.transports
    num_slots: int
    max_waiting: int  # requests that may wait for a slot before Overloaded
    failed_over: int  # requests ended because their engine died
    transport_lost: str | None  # why, while the path to the engine is being restored (the watchdog reads it)

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    def health(self) -> EngineHealth: ...

    def start(self) -> None:
        """Starts its tasks on the running loop."""

    async def stop(self) -> None:
        """Stops its tasks and gives up its claim on the table."""

    def close(self) -> None:
        """At the ingress's exit, after stop(): leaves nothing of the deployment behind that nobody else will use."""

    async def submit(self, request: Request) -> Stream:
        """Publishes `request`; raises Overloaded (a 429) or engine_unreachable's APIError (a 503)."""

    def outputs(self, stream: Stream) -> AsyncIterator[Output]:
        """The stream's records until its finish; leaving early cancels the request."""

    async def abandon(self, stream: Stream) -> None:
        """Cancels the stream's request: its consumer went away."""

    def replaced(self) -> bool:
        """Whether a restarted engine serves another table than this client's: then end_all() and restart."""

    def end_all(self) -> None:
        """Ends every request (replaced): those in slots fail after what they produced, the others get a 503."""

    async def hand_over(self, to: IngressClient) -> dict[int, Stream]:
        """Stops for a switch of transport: returns the requests in flight by slot and sends those waiting to `to`
        (a table client's, when its path is lost)."""

    async def take_over(self, old: IngressClient) -> int:
        """Adopts what `old` hands over, into the same queues, and returns how many; new requests wait until it has
        (the relay client's)."""
