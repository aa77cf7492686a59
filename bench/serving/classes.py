"""Service classes in `blink bench serve`: a seeded mix of latency-sensitive and best-effort requests, each class's
SLOs sent with its requests, and each class's figures with its SLO attainment.

Attainment is a share of the class's requests that met an SLO, two ways: of its completed requests (how well the
server served what it served) and of all its requests, a failed one counting as a miss (what its clients saw).
TPOT is figures.py's, (E2EL - TTFT) / (output tokens - 1); a request with one output token meets any TPOT SLO.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from blink.bench.lib.backends import RequestRecord
from blink.bench.lib.dataset import SampleRequest
from blink.bench.lib.figures import RequestTimes, compute, report_row

CLASSES = ("latency_sensitive", "best_effort")
ALIASES = {"ls": "latency_sensitive", "be": "best_effort"} | {name: name for name in CLASSES}
SLO_METRICS = ("ttft", "tpot")
# compute()'s figures that a class's block keeps; the rest (peaks, ITL) describe the run, not a class's share of it
KEPT = ("completed", "failed", "total_output_tokens", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
        "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "error_counts")

ClassSlos = dict[str, dict[str, float]]  # class -> {"ttft": ms, "tpot": ms}, either metric optional


def class_name(alias: str) -> str:
    try:
        return ALIASES[alias.strip()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown service class {alias.strip()!r}: want one of "
                                         f"{', '.join(ALIASES)}") from None


def parse_mix(text: str) -> dict[str, float]:
    """`ls:0.2,be:0.8` -> the classes' shares, normalised to sum to 1, in CLASSES order (so that the order the
    user wrote them in does not change the draw); a class with weight 0 is left out."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        alias, colon, value = part.partition(":")
        if not colon:
            raise argparse.ArgumentTypeError(f"{part!r}: want CLASS:WEIGHT, e.g. ls:0.2,be:0.8")
        name = class_name(alias)
        try:
            weight = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: {value!r} is not a number") from None
        if not (math.isfinite(weight) and weight >= 0):
            raise argparse.ArgumentTypeError(f"{part!r}: a weight must be a finite number >= 0")
        if name in weights:
            raise argparse.ArgumentTypeError(f"{name} is given twice")
        weights[name] = weight
    total = sum(weights.values())
    if total == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every weight is 0; at least one must be positive")
    return {name: weights[name] / total for name in CLASSES if weights.get(name, 0) > 0}


def parse_slo(text: str) -> tuple[str, dict[str, float]]:
    """`ls:ttft=500,tpot=50` -> ("latency_sensitive", {"ttft": 500.0, "tpot": 50.0})."""
    alias, colon, rest = text.partition(":")
    if not colon or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: want CLASS:ttft=MS[,tpot=MS], e.g. ls:ttft=500,tpot=50")
    name, slos = class_name(alias), {}
    for part in rest.split(","):
        metric, equals, value = part.strip().partition("=")
        if metric not in SLO_METRICS or not equals:
            raise argparse.ArgumentTypeError(f"{text!r}: {part!r} is not METRIC=MS with METRIC one of "
                                             f"{', '.join(SLO_METRICS)}")
        if metric in slos:
            raise argparse.ArgumentTypeError(f"{text!r}: {metric} is given twice")
        try:
            slos[metric] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of milliseconds") from None
        if not (math.isfinite(slos[metric]) and slos[metric] > 0):
            raise argparse.ArgumentTypeError(f"{text!r}: an SLO must be a finite number of milliseconds > 0")
    return name, slos


class MergeSlos(argparse.Action):
    """Gathers --class-slo's items into one ClassSlos, refusing a class given twice."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        merged: ClassSlos = {}
        for name, slos in values:  # parse_slo's pairs
            if name in merged:
                parser.error(f"argument {option_string}: {name} is given twice")
            merged[name] = slos
        setattr(namespace, self.dest, merged)


def assign(samples: list[SampleRequest], mix: dict[str, float], seed: int) -> list[SampleRequest]:
    """Each sample with a class drawn from `mix`; the same for a seed. The draw has its own generator, seeded from
    `seed` but apart from the samplers' (which used `seed` itself), so a mix leaves the prompts as they were."""
    rng = random.Random(f"blink-bench-class-mix:{seed}")
    drawn = rng.choices(list(mix), weights=list(mix.values()), k=len(samples))
    return [replace(sample, service_class=name) for sample, name in zip(samples, drawn, strict=True)]


def class_figures(records: list[RequestRecord], duration_s: float, slos: ClassSlos) -> dict[str, dict[str, object]]:
    """Figures per class present among the records, in CLASSES order; throughput is over the whole run."""
    return {name: one_class(subset, duration_s, slos.get(name, {})) for name in CLASSES
            if (subset := [r for r in records if r.service_class == name])}


def one_class(records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float]) -> dict[str, object]:
    figures = compute(records, duration_s)
    result: dict[str, object] = {"requests": len(records), **{key: figures[key] for key in KEPT}}
    if slos_ms:
        result["slos_ms"] = dict(slos_ms)
    for metric, limit in slos_ms.items():
        met = sum(RequestTimes.of(r).meets({metric: limit}) for r in records if r.ok)
        completed = int(figures["completed"])
        result[f"{metric}_slo_attainment_completed"] = met / completed if completed else None
        result[f"{metric}_slo_attainment_all"] = met / len(records)
    return result


def class_report(name: str, figures: Mapping[str, Any], heading: str = "Service class") -> str:
    """A block per class (or other group of requests) after vLLM's, in its layout; attainment in percent."""
    rows = [("Requests:", figures["requests"]), ("Successful requests:", figures["completed"]),
            ("Failed requests:", figures["failed"]), ("Output token throughput (tok/s):", figures["output_throughput"])]
    rows += [(f"{stat} {metric.upper()} (ms):", figures[f"{key}_{metric}_ms"]) for metric in SLO_METRICS
             for stat, key in (("Mean", "mean"), ("Median", "median"), ("P99", "p99"))]
    for metric, limit in figures.get("slos_ms", {}).items():
        rows.append((f"{metric.upper()} SLO (ms):", float(limit)))
        for share, label in (("completed", "completed"), ("all", "all requests")):
            value = figures[f"{metric}_slo_attainment_{share}"]
            rows.append((f"{metric.upper()} SLO attainment, {label} (%):", None if value is None else value * 100))
    lines = ["{:=^50}".format(f" {heading}: {name} "), *(report_row(label, value) for label, value in rows)]
    return "\n".join([*lines, "=" * 50])
