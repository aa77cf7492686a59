"""The ingress's replica of a remote slot table: the same layout, the same methods, over remote memory.

The ingress runs SlotClient on a local copy of the table. Every method that writes pushes the bytes it wrote,
in the order the `shm` transport makes them visible: a request's payload, then the state word that publishes
it. What the engine writes is pulled before the ingress reads it: a slot's control words, then its counters
(`produced` after `state`, as SlotTable.read reads them), then, once those have landed, the part of its output
window they publish. So the byte layout and the publish ordering are exactly the `shm` transport's; only the
copies differ (`MappedMemory` on one host, RDMA verbs across the NIC).
"""

from __future__ import annotations

import contextlib
import mmap
import time
from pathlib import Path

from blink.shared.remote_memory import Region, RemoteMemory
from blink.shared.slot_table import HEADER, HEADER_BYTES, Client, Geometry, Output, Request, SlotTable, slot_dtype

_HEADER_FIELDS = ("engine_state", "failovers", "epoch", "steps", "last_step_ns", "client", "admission_limit")


class ReplicaTable(SlotTable):
    transport = "rdma"

    def __init__(self, remote: RemoteMemory, geometry: Geometry):
        size = SlotTable.size_for(geometry)
        local = mmap.mmap(-1, size)
        super().__init__(Path(remote.name), local, geometry)
        self.remote = remote
        remote.attach(local)
        self._record = slot_dtype(geometry)
        self._heartbeat = (-1, time.monotonic())  # the last heartbeat seen, and when (the engine's clock is not ours)
        remote.read([(0, size)])

    def rebind(self, remote: RemoteMemory) -> None:
        """Moves to a new connection (the old one was lost) and pulls the whole table again."""
        with contextlib.suppress(Exception):  # a lost connection may fail to close too; it is dropped either way
            self.remote.close()
        self.remote = remote
        remote.attach(self.mapping)
        remote.read([(0, self.size_for(self.geometry))])

    # -- layout ----------------------------------------------------------------------------------------------

    def _field(self, slot: int, name: str) -> Region:
        dtype, offset = self._record.fields[name][:2]
        return HEADER_BYTES + slot * self._record.itemsize + offset, dtype.itemsize

    def _span(self, slot: int, first: str, last: str) -> Region:
        start, _ = self._field(slot, first)
        end, length = self._field(slot, last)
        return start, end + length - start

    # -- pulls -------------------------------------------------------------------------------------------------

    def refresh_header(self) -> None:
        first, last = HEADER.fields[_HEADER_FIELDS[0]][1], HEADER.fields[_HEADER_FIELDS[-1]]
        self.remote.read([(first, last[1] + last[0].itemsize - first)])
        beat = int(self.header["last_step_ns"])
        if beat != self._heartbeat[0]:
            self._heartbeat = (beat, time.monotonic())

    def heartbeat_age_s(self) -> float:
        return time.monotonic() - self._heartbeat[1]

    def refresh(self, slots: list[int]) -> None:
        """Pulls what the engine wrote into these slots: state, then counters, then the window they publish."""
        self.refresh_header()
        if not slots:
            return
        self.remote.read([r for s in slots for r in (self._span(s, "state", "cancel"),
                                                        self._span(s, "produced", "wait_ms"))])
        produced, consumed = self.slots["produced"], self.slots["consumed"]
        windows = [self._span(s, "tokens", "top_logprobs") for s in slots if produced[s] != consumed[s]]
        if windows:
            self.remote.read(windows)

    # -- pushes: each writer's method, then its bytes, in the order shm makes them visible ---------------------

    def claim(self, client: Client, force: bool = False) -> None:
        self.refresh_header()
        super().claim(client, force)
        offset = HEADER.fields["client"][1]
        self.remote.write([(offset, 4)])

    def publish(self, slot: int, request: Request) -> int:
        seq = super().publish(slot, request)
        self.remote.write([self._span(slot, "seq", "finish_reason"), self._field(slot, "state")])
        return seq

    def read(self, slot: int) -> Output:
        out = super().read(slot)
        self.remote.write([self._field(slot, "consumed")])
        return out

    def cancel(self, slot: int) -> None:
        super().cancel(slot)
        self.remote.write([self._field(slot, "cancel")])

    def free(self, slot: int) -> None:
        super().free(slot)
        self.remote.write([self._field(slot, "state")])

    def reclaim(self, slot: int) -> None:
        super().reclaim(slot)
        self.remote.write([self._field(slot, "state")])

    def resubmit(self, slot: int) -> None:
        super().resubmit(slot)
        self.remote.write([self._field(slot, "epoch")])

    def release_client(self, client: Client) -> None:
        super().release_client(client)
        self.remote.write([(HEADER.fields["client"][1], 4)])

    def close(self) -> None:
        super().close()
        self.remote.close()

    def unlink(self) -> None:
        """The segment is the engine host's to remove."""

    def remove_if_abandoned(self) -> None:
        """The segment is the engine host's to remove."""
