"""The KV-pressure phase of `blink bench gpu` (issue 18): rotation against recompute in each drive mode.

`blink serve` with a page pool far smaller than its requests need, with `--swap-space 4` (preempted requests'
pages rotate to host memory) and then 0 (they are recomputed), loaded by `blink bench serve` with a class mix and
SLOs: TTFT SLO attainment and P99 TTFT per class, throughput, and the preemptions the engine counted.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx

from blink.bench.gpu.drive import drive_modes, model_dir
from blink.bench.gpu.interference import bench_serve, cpu_layout
from blink.bench.lib.server import running_server


def kv_pressure(out: dict, dry_run: bool, save) -> None:
    nic, _, _ = cpu_layout()
    directory = model_dir("llama3-1b", dry_run)
    weights = [] if dry_run else ["--load-format", "dummy", "--dtype", "bfloat16"]
    out["num_pages"] = pages = 24 if dry_run else 400  # 16-token pages: a small part of what the load asks for
    load = ["--num-prompts", "16" if dry_run else "200", "--request-rate", "inf" if dry_run else "40",
            "--dataset-name", "random", "--random-input-len", "48" if dry_run else "512",
            "--random-output-len", "16" if dry_run else "256", "--ignore-eos", "--class-mix", "ls:0.2,be:0.8",
            "--class-slo", "ls:ttft=1000,tpot=200", "be:ttft=20000", "--disable-tqdm", "--no-energy",
            "--tokenizer", str(directory)]
    out["runs"] = runs = {}
    for mode in drive_modes(dry_run):
        for swap in ("4", "0"):
            policy = "rotation" if swap != "0" else "recompute"
            with tempfile.TemporaryDirectory() as tmp, running_server(
                    Path(tmp), "--model", str(directory), *weights, "--drive", mode, "--max-num-seqs", "64",
                    "--max-model-len", "256" if dry_run else "1024", "--num-pages", str(pages), "--swap-space", swap,
                    timeout_s=240) as server:
                figures = bench_serve(server.url, nic, load, Path(tmp) / "run")
                metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
                figures["preemptions"] = next((float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                               if line.startswith("blink:num_preemptions_total")), None)
            runs.setdefault(mode, {})[policy] = figures
            save(out)
