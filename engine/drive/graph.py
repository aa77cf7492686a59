"""The `graph` drive mode: the device step captured as CUDA graphs, one per token bucket, replayed ahead by a host
thread that never waits for a step's result.

The thread picks each replay's bucket from the demand the device published (a few steps stale: a step planned
at a smaller bucket than its demand just computes fewer tokens, a chunked prefill). It keeps up to `ahead` replays
queued, so a host thread that is descheduled by a noisy neighbour does not stall the GPU. When the device reports
nothing resident and the table holds nothing new, it backs off (50 µs up to 1 ms) instead of replaying.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import structlog
import torch

from blink.engine.drive.device_step import DeviceDriver, DeviceStep
from blink.shared.slot_table import SlotTable

log = structlog.get_logger()

IDLE_BACKOFF_S = (50e-6, 1e-3)


def capture_buckets(step: DeviceStep, stream: torch.cuda.Stream, keep_graph: bool = False
                    ) -> dict[int, torch.cuda.CUDAGraph]:
    """One graph per token bucket, largest first, sharing one memory pool: a step's intermediates die inside it
    and the graphs never run concurrently. Each bucket runs twice first (Triton compiles, allocator warms)."""
    stream.wait_stream(torch.cuda.current_stream(step.engine.device))  # the step's buffers were set on that one
    with torch.cuda.stream(stream):
        for bucket in step.buckets:
            for _ in range(2):
                step.clock[0] = time.monotonic()  # real steps: a request they admit gets its deadline from it
                step.run(bucket)
    stream.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for bucket in reversed(step.buckets):
        graph = torch.cuda.CUDAGraph(keep_graph=keep_graph) if keep_graph else torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            step.run(bucket)
        graphs[bucket] = graph
    stream.synchronize()
    return graphs


class GraphDriver(DeviceDriver):
    mode = "graph"

    def __init__(self, step: DeviceStep, table: SlotTable, ahead: int = 4):
        if step.engine.device.type != "cuda":
            raise RuntimeError("the graph drive mode needs a CUDA device")
        self.step, self.table, self.ahead = step, table, ahead
        self.stream = torch.cuda.Stream(step.engine.device)
        started = time.perf_counter()
        self.graphs = capture_buckets(step, self.stream)
        log.info("step graphs captured", buckets=step.buckets, seconds=round(time.perf_counter() - started, 2))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="graph-drive", daemon=True)
        self.replays = 0

    def start(self) -> None:
        self.step.grammars.start()  # the gate constrained records wait at until their grammar is on the device
        self._thread.start()

    def stop(self) -> None:
        """Returns once every replay it queued has run."""
        self._stop.set()
        self._thread.join()
        self.stream.synchronize()
        self.step.grammars.stop()

    def close(self) -> None:
        if self._thread.is_alive():
            self.stop()
        self.graphs.clear()
        self.step.close()

    def _loop(self) -> None:
        try:
            self._replay()
        except BaseException as e:  # the service learns of it and exits; the watchdog restarts the engine
            self.failure = e

    def _replay(self) -> None:
        step, queued = self.step, deque()
        torch.cuda.set_device(step.engine.device)
        backoff = IDLE_BACKOFF_S[0]
        while not self._stop.is_set():
            step.clock[0] = time.monotonic()
            demand = int(step.demand[0])
            if self.idle():  # nothing resident, or each resident request waits for its reader
                time.sleep(backoff)
                backoff = min(backoff * 2, IDLE_BACKOFF_S[1])
                continue
            backoff = IDLE_BACKOFF_S[0]
            while len(queued) >= self.ahead and not queued[0].query():
                time.sleep(20e-6)  # the device is `ahead` steps behind: let it catch up, without blocking on it
            while queued and queued[0].query():
                queued.popleft()
            with torch.cuda.stream(self.stream):
                self.graphs[step.bucket_for(demand)].replay()
                done = torch.cuda.Event()
                done.record(self.stream)
            queued.append(done)
            self.replays += 1
            if demand == 0:  # resident but paused (slow readers) or just admitted: no need to spin
                time.sleep(IDLE_BACKOFF_S[0])

