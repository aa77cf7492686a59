"""Sends a workload at a request rate: arrivals from a gamma process, optionally capped in concurrency.

The arrival gaps are gamma-distributed with mean 1/rate and shape `burstiness` (1 is a Poisson process; below
1 burstier, above 1 more regular), as in vLLM's benchmark. The schedule is fixed up front from the seed, and
each request is sent at its scheduled time measured from the start, so a slow send does not push the rest
back. With `max_concurrency`, a request past its time waits for a free place; its timings start when it is
sent, as a client's would.
"""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
from tqdm.asyncio import tqdm

from blink.bench.lib.backends import Backend, RequestRecord
from blink.bench.lib.dataset import SampleRequest


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `n` requests is due; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("the request rate and burstiness must be positive")
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


async def run_load(backend: Backend, samples: list[SampleRequest], rate: float, burstiness: float, seed: int,
                   max_concurrency: int | None = None, progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Sends every sample on schedule; returns the records in sample order and the run's duration (s)."""
    due = arrival_times(len(samples), rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(samples), disable=not progress, desc=f"rate {rate:g}/s", unit="req")

    async def one(sample: SampleRequest) -> RequestRecord:
        if limit is None:
            record = await backend(sample)
        else:
            async with limit:
                record = await backend(sample)
        bar.update(1)
        return record

    start = time.perf_counter()
    tasks = []
    try:
        for sample, at in zip(samples, due, strict=True):
            if (wait := start + at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(sample)))
        records = await asyncio.gather(*tasks)
    finally:  # interrupted: no request is left running behind the report
        for task in tasks:
            task.cancel()
        bar.close()
    return list(records), time.perf_counter() - start
