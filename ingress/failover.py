"""What keeps a table client's requests whole when something fails: the engine (a new epoch), a previous ingress
(orphan slots), the path to the table (rdma's relink) or the transport itself (a hand-over to another).

Failover: when the table's epoch moves on (a watchdog declared the engine dead, or a new engine took the table
over), a request no engine admitted yet is resubmitted to the new epoch, and one the dead engine held ends with
Finish.FAILED after the tokens it did produce. Slots a dead ingress left behind are cancelled and reclaimed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from blink.ingress.client import IngressClient, Stream
from blink.ingress.errors import engine_unreachable
from blink.ingress.slot_pool import SlotPool
from blink.shared.remote_memory import TransportLost
from blink.shared.slot_table import Finish, Output, Request, SlotState, SlotTable

log = structlog.get_logger()
RELINK_S = 0.2  # between attempts to restore a lost path to the table


class Rerouted(Exception):
    """The transport was switched while this request waited for a slot: submit it to `to`."""

    def __init__(self, to: IngressClient):
        super().__init__("rerouted")
        self.to = to


class _Unreachable:
    """Where a client whose table no engine serves sends what is submitted to it: a 503."""

    async def submit(self, request: Request) -> Stream:
        raise engine_unreachable()


class Failover:
    def __init__(self, table: SlotTable, pool: SlotPool, busy: dict[int, Stream],
                 relink: Callable[[], None] | None = None):
        """busy: the client's requests in slots, by slot; relink: reconnects a replica table whose path was lost
        (rdma)."""
        self.table, self.pool, self.busy, self._relink = table, pool, busy, relink
        self.orphans: set[int] = set()  # slots a previous ingress left busy: cancelled, freed once ended
        self.epoch_seen = int(table.header["epoch"])  # a change sends the poller through fail_over
        self.transport_lost: str | None = None  # why, while the path to the table is being restored
        self.failed_over = 0  # requests ended because their engine died
        self.handed_to: IngressClient | _Unreachable | None = None  # where submissions go once this client is done

    def resync(self, keep: frozenset[int] | set[int]) -> None:
        """Sorts every slot by the table: free ones are ours to hand out; busy ones not in `keep` belong to nobody
        here (a previous ingress, or a publish whose reply was lost), so they are cancelled and reclaimed."""
        free = []
        for slot in range(self.table.geometry.num_slots):
            if self.table.slots[slot]["state"] == SlotState.FREE:
                free.append(slot)
            elif slot not in keep:
                self.orphans.add(slot)
                self.table.cancel(slot)
        self.pool.reset(free)

    def reclaim_orphans(self) -> None:
        for slot in list(self.orphans):
            state = self.table.slots[slot]["state"]
            if state == SlotState.FINISHED:
                self.table.free(slot)
            elif self.table.orphaned(slot):
                self.table.reclaim(slot)
            elif state != SlotState.FREE:
                continue
            self.orphans.discard(slot)
            self.pool.release(slot)

    def follow_epoch(self) -> bool:
        """Fails over when the table's epoch moved on since the last look; whether it did."""
        if (epoch := int(self.table.header["epoch"])) == self.epoch_seen:  # a scalar read per pass
            return False
        self._fail_over()
        self.epoch_seen = epoch
        return True

    def _fail_over(self) -> None:
        """Resubmits what the dead engine never admitted; ends what it held, after the tokens it produced."""
        for slot, stream in list(self.busy.items()):
            if not self.table.orphaned(slot):
                continue
            if self.table.slots[slot]["state"] == SlotState.SUBMITTED:
                self.table.resubmit(slot)
                continue
            self.fail(slot, stream)
            self.table.reclaim(slot)
            self.pool.release(slot)

    def fail(self, slot: int, stream: Stream) -> None:
        """Ends a request with Finish.FAILED after the tokens it did produce."""
        out = self.table.read(slot)
        stream.queue.put_nowait(Output(out.tokens, out.logprobs, out.top_ids, out.top_logprobs, Finish.FAILED))
        del self.busy[slot]
        self.failed_over += 1
        log.warning("request failed with its engine", slot=slot, epoch=int(self.table.header["epoch"]))

    async def restore(self, error: TransportLost) -> None:
        """Reconnects until the path is back (the watchdog meanwhile may switch the deployment to `zmq`, which
        adopts the requests in flight); then resumes, ending what a restarted engine no longer holds."""
        if self._relink is None:
            raise error
        self.transport_lost = str(error)
        log.warning("path to the slot table lost; reconnecting", reason=str(error))
        while self.handed_to is None:
            try:
                await asyncio.to_thread(self._relink)
            except (TransportLost, RuntimeError, TimeoutError) as e:
                self.transport_lost = str(e)
                await asyncio.sleep(RELINK_S)
                continue
            self.resync(set(self.busy))
            for slot, stream in self.busy.items():
                if stream.abandoned:
                    self.table.cancel(slot)
            self.pool.deal()
            log.info("path to the slot table restored", epoch=int(self.table.header["epoch"]))
            self.transport_lost = None
            return

    def hand_over(self, to: IngressClient) -> dict[int, Stream]:
        """For a stopped client: sends the requests waiting for a slot to `to`, and gives up those in flight."""
        self.handed_to = to
        self.pool.refuse_waiters(lambda: Rerouted(to))
        busy = dict(self.busy)
        self.busy.clear()
        return busy

    def end_all(self) -> None:
        """Ends every request with its engine, for a client whose table no engine serves any more (replaced): the
        ones in slots fail after what they produced, the waiting ones and any later one get a 503."""
        self.handed_to = _Unreachable()
        for slot, stream in list(self.busy.items()):
            self.fail(slot, stream)
        self.pool.refuse_waiters(engine_unreachable)
