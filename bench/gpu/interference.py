"""The CPU-interference phase of `blink bench gpu`: `blink serve` in each drive mode, loaded by `blink bench serve`
alone and then with every host core busy with interference processes; a quarter of the requests ask for a
structured output (a JSON schema), with figures of their own.

The ingress and the load generator get cores of their own (a SmartNIC's role and a client elsewhere); the engine
runs on the rest, the host cores, which the interference fills one process per core. What it shows: how much of
its isolated throughput and tail latency each mode keeps when a neighbour loads the host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

from blink.bench.gpu.drive import drive_modes, failure, model_dir
from blink.bench.lib.interference import Interference
from blink.bench.lib.server import running_server

FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "completed")
CLASS_FIGURES = ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms",
                 "ttft_slo_attainment_all", "tpot_slo_attainment_all")


def cpu_layout() -> tuple[str, str, int]:
    """(the ingress's and client's CPUs, the engine's, how many of them), as `0-1` lists."""
    cpus = sorted(os.sched_getaffinity(0))
    nic = cpus[:2] if len(cpus) >= 4 else cpus[:1]
    host = [c for c in cpus if c not in nic] or nic
    return ",".join(map(str, nic)), ",".join(map(str, host)), len(host)


def interference(out: dict, dry_run: bool, save) -> None:
    """save(out): what was found so far, after each run."""
    nic, host, host_count = cpu_layout()
    out["cpus"] = {"ingress_and_client": nic, "engine_and_interference": host}
    save(out)
    directory = model_dir("llama3-1b", dry_run)
    weights = [] if dry_run else ["--load-format", "dummy", "--dtype", "bfloat16"]
    load = ["--num-prompts", "12" if dry_run else "300", "--max-concurrency", "4" if dry_run else "64",
            "--dataset-name", "random", "--random-input-len", "16" if dry_run else "256",
            "--random-output-len", "8" if dry_run else "128", "--ignore-eos", "--disable-tqdm",
            "--structured-output-ratio", "0.25"]  # issue 40: constrained requests' TPOT beside the plain ones
    # The pages 64 requests of 1,024 tokens hold (16-token pages), not 90% of the GPU: a server still draining after
    # a cut phase leaves the next phase its memory.
    pages = [] if dry_run else ["--num-pages", str(64 * 1024 // 16 + 1)]
    results: dict[str, dict] = {}
    out["runs"] = results
    for mode in drive_modes(dry_run):
        results[mode] = {}
        try:  # a mode that fails to start or serve is a finding; the next mode still runs
            with tempfile.TemporaryDirectory() as tmp, running_server(
                    Path(tmp), "--model", str(directory), *weights, "--drive", mode, "--max-num-seqs", "64",
                    "--max-model-len", "1024", *pages, "--swap-space", "0", "--ingress-cpus", nic,
                    "--engine-cpus", host, timeout_s=120) as server:
                for condition in ("isolated", "interference"):
                    # Started here, not by the client: the client is pinned to the NIC's cores, the load to the host's.
                    with Interference(host_count, [int(c) for c in host.split(",")]) \
                            if condition == "interference" else nullcontext():
                        results[mode][condition] = bench_serve(server.url, nic,
                                                               [*load, "--tokenizer", str(directory)],
                                                               Path(tmp) / condition)
                    save(out)
        except Exception as e:
            results[mode]["error"] = failure(e)
            save(out)
            continue
        iso, loaded = results[mode].get("isolated", {}), results[mode].get("interference", {})
        if iso.get("output_throughput") and loaded.get("output_throughput"):
            results[mode]["throughput_kept"] = loaded["output_throughput"] / iso["output_throughput"]
            results[mode]["p99_tpot_ratio"] = loaded["p99_tpot_ms"] / iso["p99_tpot_ms"]
            results[mode]["p99_ttft_ratio"] = loaded["p99_ttft_ms"] / iso["p99_ttft_ms"]
            tpots = [(run.get("constrained") or {}).get("p99_tpot_ms") for run in (iso, loaded)]
            if all(tpots):
                results[mode]["constrained_p99_tpot_ratio"] = tpots[1] / tpots[0]
    _energy_against_host(results)


def _energy_against_host(results: dict[str, dict]) -> None:
    """Each mode's GPU joules per output token over the host mode's, per condition (the Blink paper's figure:
    -48.6% against host-driven engines); absent where NVML gave none."""
    host = results.get("host", {})
    for mode, runs in results.items():
        ratios = {condition: run["joules_per_output_token"] / host[condition]["joules_per_output_token"]
                  for condition, run in runs.items() if isinstance(run, dict) and run.get("joules_per_output_token")
                  and (host.get(condition) or {}).get("joules_per_output_token")}
        if mode != "host" and ratios:
            runs["energy_per_token_vs_host"] = ratios


def bench_serve(url: str, cpus: str, flags: list[str], result_dir: Path, timeout_s: float = 150) -> dict:
    """`blink bench serve` against `url`, pinned to `cpus`: vLLM's figures, and each class's when there are classes."""
    result_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "blink.services.cli", "bench", "serve", "--base-url", url, "--result-dir",
           str(result_dir), "--result-filename", "result.json", *flags]
    pin = [int(c) for c in cpus.split(",")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=lambda: os.sched_setaffinity(0, pin))
    except subprocess.TimeoutExpired as e:
        return {"error": f"no result within {timeout_s:g} s: {(e.stdout or b'')[-1500:]!r}"}
    path = result_dir / "result.json"
    if done.returncode != 0 or not path.is_file():
        return {"error": (done.stdout + done.stderr)[-2000:]}
    saved = json.loads(path.read_text())
    figures = {k: saved.get(k) for k in FIGURES}
    energy = saved["runs"][-1].get("energy") or {}
    figures["joules_per_output_token"] = energy.get("joules_per_output_token")  # None where NVML gave none
    figures["mean_watts"] = energy.get("mean_watts")
    groups = {**(saved["runs"][-1].get("classes") or {}), **(saved["runs"][-1].get("structured") or {})}
    for name, kept in groups.items():  # with --class-mix, --structured-output-ratio
        figures[name] = {k: kept.get(k) for k in CLASS_FIGURES}
    return figures
