"""Prometheus metrics with vLLM's names under the `blink:` prefix."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from blink.ingress.slots import SlotClient, Stream

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, model: str, drive: str, transport: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model}
        self._labels = labels

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS, registry=r).labels(**labels)

        self.running = Gauge("blink:num_requests_running", "Requests in slots", list(labels), registry=r)
        self.waiting = Gauge("blink:num_requests_waiting", "Requests waiting for a slot", list(labels), registry=r)
        self.kv_usage = Gauge("blink:kv_cache_usage_perc", "KV cache pages in use (0-1)", list(labels), registry=r)
        self.preemptions = Gauge("blink:num_preemptions_total", "Preemptions by the engine", list(labels),
                                 registry=r)
        self.ttft = histogram("blink:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("blink:inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("blink:e2e_request_latency_seconds", "End-to-end request latency")
        self.queue_time = histogram("blink:request_queue_time_seconds", "Time from submission to admission")
        self.prompt_tokens = Counter("blink:prompt_tokens", "Prompt tokens processed", list(labels),
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("blink:generation_tokens", "Tokens generated", list(labels),
                                         registry=r).labels(**labels)
        self.info = Gauge("blink:engine_info", "The engine's drive mode and transport",
                          ["drive", "transport", *labels], registry=r)
        self.drive = drive
        self.set_transport(transport)
        self.degraded = Gauge("blink:degraded", "1 while the deployment runs a fallback transport or device",
                              list(labels), registry=r)
        self.failovers = Gauge("blink:engine_failovers_total", "Engines the watchdog declared dead",
                               list(labels), registry=r)
        self.failed_requests = Gauge("blink:num_requests_failed_over_total",
                                     "Requests ended with an error because their engine died", list(labels),
                                     registry=r)

    def set_transport(self, transport: str) -> None:
        self.info.clear()
        self.info.labels(drive=self.drive, transport=transport, **self._labels).set(1)

    def finished(self, stream: Stream, generated: int, prompt_tokens: int) -> None:
        now = time.monotonic()
        self.e2e.observe(now - stream.submitted_at)
        if stream.admitted_at is not None:
            self.queue_time.observe(stream.admitted_at - stream.submitted_at)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)

    def render(self, client: SlotClient, kv_used: int | None, kv_total: int | None, preemptions: int | None,
               degraded: bool) -> bytes:
        self.degraded.labels(**self._labels).set(int(degraded))
        self.running.labels(**self._labels).set(client.running)
        self.waiting.labels(**self._labels).set(client.waiting)
        self.failovers.labels(**self._labels).set(client.health().failovers)
        self.failed_requests.labels(**self._labels).set(client.failed_over)
        if kv_total:
            self.kv_usage.labels(**self._labels).set(kv_used / kv_total)
        if preemptions is not None:
            self.preemptions.labels(**self._labels).set(preemptions)
        return generate_latest(self.registry)
