"""`blink bench plot RESULTS...`: P99 TTFT and P99 TPOT against request rate, a line per result set.

Each `blink bench serve` JSON file is one result set (its label names the line; files with the same label are
merged). Rates are on a log scale; an infinite rate ("all at once") is drawn one doubling past the highest.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt
from matplotlib.ticker import LogFormatter

PANELS = {"p99_ttft_ms": "P99 time to first token (ms)", "p99_tpot_ms": "P99 time per output token (ms)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", type=Path, help="`blink bench serve` JSON files")
    p.add_argument("--output-dir", type=Path, default=Path("."))
    p.add_argument("--prefix", default="serve", help="file names: PREFIX-p99_ttft.png and PREFIX-p99_tpot.png")
    p.add_argument("--title", help="a title over both plots")


def run(args: argparse.Namespace) -> None:
    for path in plot(args.results, args.output_dir, args.prefix, args.title):
        print(f"wrote {path}")


def load_series(paths: list[Path]) -> dict[str, list[tuple[float, dict]]]:
    """Label -> [(rate, run figures)] sorted by rate."""
    series: dict[str, list[tuple[float, dict]]] = defaultdict(list)
    for path in paths:
        result = json.loads(Path(path).read_text())
        if "runs" not in result:
            raise SystemExit(f"{path}: not a `blink bench serve` result (no runs)")
        label = result["label"]
        if label in series:  # another file with the same label: its own line, not a zig-zag through both
            label = f"{label} ({Path(path).stem})"
        for run in result["runs"]:
            series[label].append((float(run["request_rate"]), run))
    return {label: sorted(points, key=lambda p: p[0]) for label, points in series.items()}


def plot(paths: list[Path], output_dir: Path, prefix: str = "serve", title: str | None = None) -> list[Path]:
    series = load_series(paths)
    finite = [rate for points in series.values() for rate, _ in points if math.isfinite(rate)]
    inf_at = max(finite, default=1.0) * 2  # where "inf" is drawn: one doubling past the highest rate
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, ylabel in PANELS.items():
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        for label, points in series.items():
            xs = [rate if math.isfinite(rate) else inf_at for rate, run in points if run.get(key) is not None]
            ys = [run[key] for _, run in points if run.get(key) is not None]
            ax.plot(xs, ys, marker="o", label=label)
        ticks = sorted(set(finite))
        if any(not math.isfinite(rate) for points in series.values() for rate, _ in points):
            ticks.append(inf_at)
        ax.set_xscale("log", base=2)  # sweeps double the rate: equal steps
        ax.set_xticks(ticks, [f"{t:g}" if t != inf_at or inf_at in finite else "inf" for t in ticks])
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(ylabel)
        if any(len(line.get_ydata()) for line in ax.lines):  # else an empty plot (all failed), not a crash
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(LogFormatter())  # plain numbers (20, 300), not 2×10¹
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        ax.set_title(f"{title}: {ylabel}" if title else ylabel)
        fig.tight_layout()
        path = output_dir / f"{prefix}-{key.removesuffix('_ms')}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
