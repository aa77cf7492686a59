"""A table client's one poller task: reads every busy slot's output window into that request's stream.

A request whose reader falls behind is not read further, so its window fills and the engine pauses it.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import structlog

from blink.ingress.client import Stream
from blink.ingress.failover import Failover
from blink.ingress.slot_pool import SlotPool
from blink.shared.remote_memory import TransportLost
from blink.shared.slot_table import Finish, SlotState, SlotTable

log = structlog.get_logger()
POLL_MIN_S, POLL_MAX_S = 0.0002, 0.002


class Poller:
    def __init__(self, table: SlotTable, pool: SlotPool, busy: dict[int, Stream], failover: Failover):
        self.table, self.pool, self.busy, self.failover = table, pool, busy, failover
        self.wake = asyncio.Event()  # set when there is something to poll: a request published or adopted

    async def run(self) -> None:
        """Runs for the client's life: a failed pass is logged and the next one tries again."""
        while True:
            try:
                await self._poll_forever()
            except asyncio.CancelledError:
                raise
            except TransportLost as e:
                await self.failover.restore(e)
            except Exception:
                log.exception("slot poller failed; restarting it")
                await asyncio.sleep(POLL_MAX_S)

    async def _poll_forever(self) -> None:
        # Field views, gathered per poll: indexing whole records would copy their prompts and windows.
        slots = self.table.slots
        state_of, produced, consumed = slots["state"], slots["produced"], slots["consumed"]
        finished, submitted = int(SlotState.FINISHED), int(SlotState.SUBMITTED)  # plain ints: enums are slow here
        orphans, pause = self.failover.orphans, POLL_MIN_S
        while True:
            if not self.busy and not orphans:
                self.wake.clear()
                await self.wake.wait()
            busy = np.fromiter(self.busy, dtype=np.int64)
            # A replica (rdma) pulls what the engine wrote; under shm the table is the engine's memory.
            self.table.refresh([*busy.tolist(), *orphans])
            if orphans:
                self.failover.reclaim_orphans()
            if self.failover.follow_epoch():
                busy = np.fromiter(self.busy, dtype=np.int64)
            states = state_of[busy]
            news = (produced[busy] != consumed[busy]) | (states == finished)
            now = time.monotonic()
            # Poll fast while outputs flow, back off while the engine is busy computing.
            pause = POLL_MIN_S if news.any() else min(POLL_MAX_S, pause * 2)
            for slot, admitted in zip(busy[news].tolist(), (states[news] != submitted).tolist(), strict=True):
                stream = self.busy[slot]
                if admitted and stream.admitted_at is None:
                    stream.admitted_at = now
                if stream.queue.qsize() > self.table.geometry.window and not stream.abandoned:
                    continue  # the reader is behind: leave the window full so the engine pauses
                out = self.table.read(slot)
                if not stream.abandoned:
                    stream.queue.put_nowait(out)
                if out.finish != Finish.NONE:
                    del self.busy[slot]
                    self.table.free(slot)
                    self.pool.release(slot)
            await asyncio.sleep(pause)
