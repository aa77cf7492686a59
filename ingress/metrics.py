"""Prometheus metrics with vLLM's names under the `blink:` prefix."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from blink.ingress.client import IngressClient, Stream
from blink.shared.control import EngineStatus
from blink.shared.service_class import ServiceClass
from blink.shared.slot_table import Finish, RequestStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Totals:
    """Totals kept elsewhere (by the engine, the watchdog, the client), exposed as Prometheus counters (`<name>_total`,
    as vLLM's): set to the latest value at each scrape, never counted here. One that goes back (an engine restarted
    by failover) is a counter reset, which rate() takes."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self._labels = labels
        self._families: dict[str, tuple[str, tuple[str, ...]]] = {}  # name: (help, its own label names)
        self._values: dict[str, dict[tuple[str, ...], float]] = {}
        registry.register(self)

    def declare(self, name: str, doc: str, *labels: str) -> None:
        self._families[name] = (doc, labels)
        self._values[name] = {}

    def set(self, name: str, value: float, *label_values: str) -> None:
        self._values[name][label_values] = value

    def collect(self):
        for name, (doc, own) in self._families.items():
            family = CounterMetricFamily(name, doc, labels=[*self._labels, *own])
            for values, total in self._values[name].items():
                family.add_metric([*self._labels.values(), *values], total)
            yield family


@dataclass
class ChoiceRecord:
    """One finished choice, as the ingress saw it."""

    service_class: ServiceClass
    generated: int
    prompt_tokens: int
    ttft_s: float | None
    tpot_s: float | None  # mean time per output token after the first
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    outcome: Finish  # STOP, LENGTH, ABORT (the client left or cancelled), FAILED (with its engine)
    stats: RequestStats | None  # what the engine did to it, when it finished there


@dataclass
class ClassMetrics:
    """The per-class series, bound to their labels."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    engine_wait: Histogram
    slo_requests: dict[str, Counter]
    slo_attained: dict[str, Counter]
    attainment: Gauge  # unbound: a class's series appears once one of its requests was judged
    labels: dict[str, str]
    preemptions: Counter
    pages: dict[str, Counter]
    bytes: dict[str, Counter]
    judged: dict[str, list[int]]  # slo -> [requests, attained], for the gauge

    def judge(self, slo: str, met: bool) -> None:
        count = self.judged[slo]
        count[0] += 1
        count[1] += met
        self.slo_requests[slo].inc()
        if met:
            self.slo_attained[slo].inc()
        self.attainment.labels(**self.labels, slo=slo).set(count[1] / count[0])


class Metrics:
    def __init__(self, model: str, drive: str, transport: str, policies: dict[str, str] | None = None):
        """policies: how the engine schedules, as labels of blink:engine_info (scheduling_policy, kv_rotation)."""
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model}
        self._labels = labels
        per_class = [*labels, "service_class"]

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, per_class, buckets=LATENCY_BUCKETS, registry=r)

        self.running = Gauge("blink:num_requests_running", "Requests in slots", list(labels), registry=r)
        self.waiting = Gauge("blink:num_requests_waiting", "Requests waiting for a slot", list(labels), registry=r)
        self.kv_usage = Gauge("blink:kv_cache_usage_perc", "KV cache pages in use (0-1)", list(labels), registry=r)
        self.host_kv_usage = Gauge("blink:cpu_cache_usage_perc", "Host-memory KV pages (rotation) in use (0-1)",
                                   list(labels), registry=r)
        self.totals = t = Totals(r, labels)
        t.declare("blink:num_preemptions", "Preemptions by the engine")
        # Speculative decoding (--speculative-config), vLLM's counters.
        t.declare("blink:spec_decode_num_drafts", "Steps in which a request drafted tokens")
        t.declare("blink:spec_decode_num_draft_tokens", "Draft tokens proposed")
        t.declare("blink:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        t.declare("blink:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position",
                  "position")
        self._histograms = {
            "ttft": histogram("blink:time_to_first_token_seconds", "Time to first token"),
            "itl": histogram("blink:inter_token_latency_seconds", "Time between output tokens"),
            "e2e": histogram("blink:e2e_request_latency_seconds", "End-to-end request latency"),
            "queue_time": histogram("blink:request_queue_time_seconds", "Time from arrival to admission"),
            "engine_wait": histogram("blink:request_engine_wait_seconds",
                                     "Time admitted but not scheduled: waiting, preempted or rotated out"),
        }
        slo = [*per_class, "slo"]
        self._slo_requests = Counter("blink:slo_requests", "Requests with an SLO (ttft, tpot) that ended in the "
                                     "engine", slo, registry=r)
        self._slo_attained = Counter("blink:slo_attained", "Of those, the requests that completed within it", slo,
                                     registry=r)
        self._attainment = Gauge("blink:slo_attainment", "SLO attainment since the start (0-1)", slo, registry=r)
        self._class_preemptions = Counter("blink:request_preemptions", "Preemptions (rotated out or recomputed) of "
                                          "the class's finished requests", per_class, registry=r)
        way = [*per_class, "direction"]
        self._pages = Counter("blink:kv_rotated_pages", "KV pages rotated to host memory (out) and back (in)", way,
                              registry=r)
        self._bytes = Counter("blink:kv_rotated_bytes", "Bytes of KV rotated to host memory and back", way,
                              registry=r)
        self._classes = {c: self._bind(c) for c in ServiceClass}
        self.prompt_tokens = Counter("blink:prompt_tokens", "Prompt tokens processed", list(labels),
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("blink:generation_tokens", "Tokens generated", list(labels),
                                         registry=r).labels(**labels)
        # vLLM's names, in tokens: of the prompts the engine looked up in the prefix cache, what it found there.
        self.prefix_queries = Counter("blink:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      list(labels), registry=r).labels(**labels)
        self.prefix_hits = Counter("blink:prefix_cache_hits", "Of those, the tokens found cached", list(labels),
                                   registry=r).labels(**labels)
        # Structured outputs (a grammar): by kind (json_schema, regex, grammar), served (masked on the host, in the host
        # drive mode; walked on the device, in the others) or refused (an invalid spec, or one the mode cannot walk).
        self.structured = Counter("blink:structured_output_requests", "Requests with a structured output, by kind "
                                  "and outcome (host: masked on the host; device: walked on the device; refused)",
                                  [*labels, "kind", "outcome"],
                                  registry=r)
        self.structured_refused = Counter(
            "blink:structured_output_refused_requests", "Of those refused at the ingress, by kind and reason "
            "(unsupported: this drive mode cannot serve the spec; too_large: past --max-grammar-bytes; invalid: it "
            "does not compile; timeout: it did not compile within the time limit)", [*labels, "kind", "reason"],
            registry=r)
        t.declare("blink:structured_output_engine_ended_requests", "Constrained requests the engine ended, by reason "
                  "(failed: the grammar did not compile or lower there; timeout: not within the time limit)", "reason")
        # The device modes' grammar arena (--grammar-arena-bytes): set once the engine reports one (graph, persistent).
        self.grammar_arena_used = Gauge("blink:grammar_arena_used_bytes", "Device grammar arena bytes the resident "
                                        "grammar tables take", list(labels), registry=r)
        self.grammar_arena_capacity = Gauge("blink:grammar_arena_capacity_bytes", "Device grammar arena size in bytes",
                                            list(labels), registry=r)
        self.grammar_tables = Gauge("blink:num_grammar_tables_resident", "Grammar tables in the device arena (one per "
                                    "spec, shared by its requests)", list(labels), registry=r)
        self.policies = dict(policies or {})
        self.info = Gauge("blink:engine_info", "The engine's drive mode, transport and scheduling policies",
                          ["drive", "transport", *self.policies, *labels], registry=r)
        self.drive = drive
        self.set_transport(transport)
        self.degraded = Gauge("blink:degraded", "1 while the deployment runs a fallback transport or device",
                              list(labels), registry=r)
        t.declare("blink:engine_failovers", "Engines the watchdog declared dead")
        t.declare("blink:num_requests_failed_over", "Requests ended with an error because their engine died")

    def set_transport(self, transport: str) -> None:
        self.info.clear()
        self.info.labels(drive=self.drive, transport=transport, **self.policies, **self._labels).set(1)

    def of(self, service_class: ServiceClass) -> ClassMetrics:
        return self._classes[service_class]

    def _bind(self, service_class: ServiceClass) -> ClassMetrics:
        labels = {**self._labels, "service_class": service_class.label}
        hist = {name: h.labels(**labels) for name, h in self._histograms.items()}
        slos, ways = ("ttft", "tpot"), ("out", "in")
        return ClassMetrics(
            **hist, slo_requests={s: self._slo_requests.labels(**labels, slo=s) for s in slos},
            slo_attained={s: self._slo_attained.labels(**labels, slo=s) for s in slos},
            attainment=self._attainment, labels=labels,
            preemptions=self._class_preemptions.labels(**labels),
            pages={w: self._pages.labels(**labels, direction=w) for w in ways},
            bytes={w: self._bytes.labels(**labels, direction=w) for w in ways}, judged={s: [0, 0] for s in slos})

    def finished(self, stream: Stream, record: ChoiceRecord) -> None:
        now = time.monotonic()
        m = self.of(record.service_class)
        m.e2e.observe(now - stream.submitted_at)
        if stream.admitted_at is not None:
            m.queue_time.observe(stream.admitted_at - stream.submitted_at)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.generated)
        if (stats := record.stats) is not None:
            if record.prompt_tokens:  # the choice that counts its prompt (the engine reports per request)
                self.prefix_queries.inc(record.prompt_tokens)
                self.prefix_hits.inc(stats.cached_tokens)
            m.engine_wait.observe(stats.wait_ms / 1000)
            m.preemptions.inc(stats.preemptions)
            for way, pages, size in (("out", stats.pages_out, stats.bytes_out), ("in", stats.pages_in, stats.bytes_in)):
                m.pages[way].inc(pages)
                m.bytes[way].inc(size)
        if record.outcome == Finish.ABORT:
            return  # the client left: no verdict
        completed = record.outcome in (Finish.STOP, Finish.LENGTH)
        for slo, target_ms, value_s in (("ttft", record.ttft_slo_ms, record.ttft_s),
                                        ("tpot", record.tpot_slo_ms, record.tpot_s)):
            if target_ms is None:
                continue
            # No value: no first token (a TTFT miss), or a single token (no TPOT to miss).
            met = completed and (slo == "tpot" if value_s is None else value_s * 1000 <= target_ms)
            m.judge(slo, met)

    def render(self, client: IngressClient, engine: EngineStatus | None, degraded: bool) -> bytes:
        self.degraded.labels(**self._labels).set(int(degraded))
        self.running.labels(**self._labels).set(client.running)
        self.waiting.labels(**self._labels).set(client.waiting)
        totals = self.totals
        totals.set("blink:engine_failovers", client.health().failovers)
        totals.set("blink:num_requests_failed_over", client.failed_over)
        if engine is not None:
            self.kv_usage.labels(**self._labels).set(engine.kv_pages_used / max(1, engine.kv_pages_total))
            host_usage = engine.kv_host_pages_used / max(1, engine.kv_host_pages_total)
            self.host_kv_usage.labels(**self._labels).set(host_usage)
            totals.set("blink:num_preemptions", engine.preemptions)
            if engine.spec_decode_num_accepted_tokens_per_pos:  # the engine speculates
                for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                    totals.set(f"blink:spec_decode_{name}", getattr(engine, f"spec_decode_{name}"))
                for position, count in enumerate(engine.spec_decode_num_accepted_tokens_per_pos):
                    totals.set("blink:spec_decode_num_accepted_tokens_per_pos", count, str(position))
            for reason, count in engine.structured_output_ended.items():
                totals.set("blink:structured_output_engine_ended_requests", count, reason)
            if engine.grammar_arena_bytes_total:  # the engine walks grammars on the device
                self.grammar_arena_used.labels(**self._labels).set(engine.grammar_arena_bytes_used)
                self.grammar_arena_capacity.labels(**self._labels).set(engine.grammar_arena_bytes_total)
                self.grammar_tables.labels(**self._labels).set(engine.grammar_tables_resident)
        return generate_latest(self.registry)
