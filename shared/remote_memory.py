"""Remote memory under a slot-table replica: what the `rdma` transport's verbs do, as two calls.

`write(regions)` makes the local bytes of each (offset, length) region visible in the remote table, in the
order given: a later region is never seen before an earlier one (a reliable-connected queue pair keeps RDMA
writes in order; a store to shared memory on x86-64 does too). `read(regions)` copies the remote bytes of each
region into the local replica, each region read after the one before it, and returns once all have landed.
Both raise TransportLost when the remote cannot be reached any more.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Protocol

Region = tuple[int, int]  # offset in the table, length in bytes


class TransportLost(ConnectionError):
    """The path to the remote table is gone (a completion error, a queue pair in error, a remote that left)."""


class RemoteMemory(Protocol):
    name: str

    def attach(self, local: mmap.mmap) -> None:
        """Binds the local replica the regions are copied from and into."""

    def read(self, regions: list[Region]) -> None: ...

    def write(self, regions: list[Region]) -> None: ...

    def close(self) -> None: ...


class MappedMemory:
    """Remote memory that is a mapped file on this host: the replica protocol without a NIC (tests, `blink
    doctor`'s self-check). Plain copies, in order; x86-64 keeps stores in program order."""

    def __init__(self, path: Path):
        self.name = str(path)
        fd = os.open(path, os.O_RDWR)
        try:
            self._remote = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self._local: mmap.mmap | None = None

    def attach(self, local: mmap.mmap) -> None:
        self._local = local

    def read(self, regions: list[Region]) -> None:
        self._check()
        for offset, length in regions:
            self._local[offset:offset + length] = self._remote[offset:offset + length]

    def write(self, regions: list[Region]) -> None:
        self._check()
        for offset, length in regions:
            self._remote[offset:offset + length] = self._local[offset:offset + length]

    def _check(self) -> None:
        if self._remote.closed:
            raise TransportLost(f"{self.name} is closed")

    def close(self) -> None:
        self._remote.close()
