"""The figures of a serving run, computed from its request records, with vLLM's definitions, names and labels.

TTFT: from sending to the first chunk of output. TPOT: the rest of the request's time over its other output
tokens, (E2EL - TTFT) / (output tokens - 1), for requests with more than one. ITL: the gap between one chunk
and the next, pooled over all requests. E2EL: from sending to the last chunk of output. Peak output throughput:
the most output tokens that arrived within one second of the run; peak concurrency: the most requests in
flight at one instant. Goodput: requests per second that met every SLO given.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from blink.bench.lib.backends import RequestRecord

LATENCIES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
PERCENTILES = (90, 99)


@dataclass(frozen=True)
class RequestTimes:
    """One successful request's latencies, in seconds."""

    ttft: float
    tpot: float | None  # None with fewer than two output tokens
    itls: list[float]
    e2el: float

    @classmethod
    def of(cls, r: RequestRecord) -> RequestTimes:
        last = r.chunk_times[-1] if r.chunk_times else r.end  # vLLM's end: the last chunk of output
        ttft = (r.chunk_times[0] if r.chunk_times else r.end) - r.start
        e2el = last - r.start
        tpot = (e2el - ttft) / (r.output_len - 1) if r.output_len > 1 else None
        return cls(ttft, tpot, np.diff(r.chunk_times).tolist(), e2el)

    def meets(self, slos_ms: dict[str, float]) -> bool:
        ms = {"ttft": self.ttft, "tpot": self.tpot or 0.0, "e2el": self.e2el}
        return all(ms[name] * 1000 <= limit for name, limit in slos_ms.items())


def compute(records: list[RequestRecord], duration_s: float, goodput_slos_ms: dict[str, float] | None = None,
            percentiles: tuple[float, ...] = PERCENTILES) -> dict[str, object]:
    ok = [r for r in records if r.ok]
    times = [RequestTimes.of(r) for r in ok]
    samples = {"ttft": [t.ttft for t in times], "tpot": [t.tpot for t in times if t.tpot is not None],
               "itl": [gap for t in times for gap in t.itls], "e2el": [t.e2el for t in times]}
    input_tokens, output_tokens = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    figures: dict[str, object] = {
        "completed": len(ok), "failed": len(records) - len(ok), "duration": duration_s,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (sum(t.meets(goodput_slos_ms) for t in times) / duration_s if goodput_slos_ms else None),
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "max_output_tokens_per_s": peak_output_per_second(ok),
        "max_concurrent_requests": peak_concurrency(records),
    }
    for name, values in samples.items():
        ms = np.asarray(values, dtype=float) * 1000
        figures[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else None
        figures[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else None
        figures[f"std_{name}_ms"] = float(ms.std()) if ms.size else None
        for p in percentiles:
            figures[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    figures["error_counts"] = dict(Counter(r.error for r in records if not r.ok))
    return figures


def peak_output_per_second(ok: list[RequestRecord]) -> float:
    """Most output tokens arriving in one 1-second bucket from the first request's start; a chunk's tokens are
    the request's output spread evenly over its chunks (one each, when the server streams a token per chunk)."""
    arrivals = [(t, r.output_len / len(r.chunk_times)) for r in ok for t in r.chunk_times]
    if not arrivals:
        return 0.0
    origin = min(r.start for r in ok)
    buckets: Counter[int] = Counter()
    for t, tokens in arrivals:
        buckets[int(t - origin)] += tokens
    return max(buckets.values())


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at one instant; a request ending when another starts does not overlap it."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def report(figures: dict[str, object], rate: float, max_concurrency: int | None,
           extra: dict[str, str] | None = None, metrics: tuple[str, ...] = tuple(LATENCIES),
           percentiles: tuple[float, ...] = PERCENTILES) -> str:
    """The block vLLM's `bench serve` prints, line for line, with Blink's additions (`extra`) before its end."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: object) -> None:
        lines.append(report_row(label, value))

    row("Successful requests:", figures["completed"])
    row("Failed requests:", figures["failed"])
    if max_concurrency:
        row("Maximum request concurrency:", max_concurrency)
    if rate != float("inf"):
        row("Request rate configured (RPS):", float(rate))
    row("Benchmark duration (s):", figures["duration"])
    row("Total input tokens:", figures["total_input_tokens"])
    row("Total generated tokens:", figures["total_output_tokens"])
    row("Request throughput (req/s):", figures["request_throughput"])
    if figures["request_goodput"] is not None:
        row("Request goodput (req/s):", figures["request_goodput"])
    row("Output token throughput (tok/s):", figures["output_throughput"])
    row("Peak output token throughput (tok/s):", float(figures["max_output_tokens_per_s"]))
    row("Peak concurrent requests:", figures["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", figures["total_token_throughput"])
    for name in metrics:
        lines.append(f"{LATENCIES[name]:-^50}")
        label = name.upper()
        row(f"Mean {label} (ms):", figures[f"mean_{name}_ms"])
        row(f"Median {label} (ms):", figures[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {label} (ms):", figures[f"p{p:g}_{name}_ms"])
    for label, value in (extra or {}).items():
        row(f"{label}:", value)
    lines.append("=" * 50)
    return "\n".join(lines)


def report_row(label: str, value: object, fmt: str = ".2f") -> str:
    """One line of a report block, as vLLM lays them out; "-" for a figure with no samples."""
    text = "-" if value is None else format(value, fmt) if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"
