"""CPU interference: processes that load the host as a colocated compile job would, for as long as a run lasts.

Each worker loops over three things a compiler does to a machine: it computes (hashing, which keeps a core busy
without touching memory), it allocates a fresh buffer larger than the last-level cache and writes it (so the
kernel hands it new zeroed pages: page faults), and it streams through that buffer (evicting whatever the
cache held). The buffer is freed every round, so every round faults in fresh pages again.

Workers are separate processes, stopped when the `Interference` context ends, whether the run finished, failed
or was interrupted; on Linux they also die with their parent (PR_SET_PDEATHSIG), so a killed benchmark
leaves none behind.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from blink.shared.stopping import die_with_parent


def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs reports for cpu0, or 32 MiB when it says nothing."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 << 20)


class Interference:
    """`with Interference(4, cpus=[0, 1]) as load: ...`; `load.describe()` says what ran."""

    def __init__(self, processes: int, cpus: list[int] | None = None, buffer_bytes: int | None = None):
        self.processes, self.cpus = processes, cpus
        # Past 32 MiB glibc always maps fresh pages (its mmap threshold tops out there), as a compiler's heap grows.
        self.buffer_bytes = buffer_bytes or max(2 * last_level_cache_bytes(), 64 << 20)
        self.workers: list[subprocess.Popen] = []

    def __enter__(self) -> Interference:
        try:
            for _ in range(self.processes):
                cmd = [sys.executable, "-m", "blink.bench.lib.interference", str(self.buffer_bytes), str(os.getpid())]
                pin = (lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None  # before it runs
                self.workers.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=pin))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()
        deadline = time.monotonic() + 5
        for worker in self.workers:
            try:
                worker.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()

    def describe(self) -> dict[str, object]:
        return {"processes": self.processes, "cpus": self.cpus, "pids": [w.pid for w in self.workers],
                "buffer_bytes_per_process": self.buffer_bytes,
                "work": "per round: sha256 over 1 MiB x16 (compute), then a fresh buffer of buffer_bytes written "
                        "(page faults) and summed (streaming past the last-level cache), then freed"}


def work(buffer_bytes: int, parent_pid: int) -> None:
    """One worker's loop, until SIGTERM or its parent's death."""
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C reaches the parent, which stops us in order
    block = os.urandom(1 << 20)
    round_ = 0
    while os.getppid() == parent_pid:  # the parent died before prctl took effect: reparented, so stop
        for _ in range(16):
            block = hashlib.sha256(block).digest() * (len(block) // 32)
        buffer = np.empty(buffer_bytes, dtype=np.uint8)
        buffer.fill(round_ & 0xFF)
        int(buffer.sum(dtype=np.uint64))
        del buffer
        round_ += 1


if __name__ == "__main__":
    work(int(sys.argv[1]), int(sys.argv[2]))
