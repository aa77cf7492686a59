"""A table client's free slots: handed out to latency-sensitive requests first, some reserved for them, and a bounded
line of requests waiting for one."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

from blink.ingress.client import Overloaded
from blink.shared.service_class import ServiceClass


class SlotPool:
    def __init__(self, num_slots: int, max_waiting: int, reserved_slots: int = 0):
        """reserved_slots: free slots only latency-sensitive requests may take, so that one arriving while
        best-effort work fills the table reaches the engine, which preempts at the next step."""
        self.max_waiting = max_waiting
        self.reserved_slots = min(reserved_slots, num_slots - 1)
        self.free: deque[int] = deque()
        # Waiting for a slot, per class: latency-sensitive ones are served first.
        self._waiters: dict[ServiceClass, deque[asyncio.Future[int]]] = {c: deque() for c in ServiceClass}

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    def reset(self, free: Iterable[int]) -> None:
        """The free slots as the table has them now."""
        self.free.clear()
        self.free.extend(free)

    async def acquire(self, service_class: ServiceClass) -> int:
        if len(self.free) > (0 if service_class == ServiceClass.LATENCY_SENSITIVE else self.reserved_slots):
            return self.free.popleft()
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
                self.release(waiter.result())
            elif waiter in self._waiters[service_class]:
                self._waiters[service_class].remove(waiter)
            raise

    def release(self, slot: int) -> None:
        """Gives `slot` to the first waiter in line, or back to the free ones."""
        for service_class, waiters in self._waiters.items():
            if service_class == ServiceClass.BEST_EFFORT and len(self.free) < self.reserved_slots:
                break  # this slot refills the latency-sensitive reserve
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(slot)
                    return
        self.free.append(slot)

    def deal(self) -> None:
        """Hands the free slots to the waiters, each slot once: one kept for the reserve goes back to the end."""
        for _ in range(len(self.free)):
            self.release(self.free.popleft())

    def refuse_waiters(self, error: Callable[[], BaseException]) -> None:
        """Ends every wait for a slot with error()."""
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error())
            waiters.clear()
