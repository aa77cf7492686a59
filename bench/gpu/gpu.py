"""`blink bench gpu`: first light for the device drive modes, validated and measured in one command that fits one
call of a lent GPU machine (`--budget-s`, 9 minutes by default; `--profile quick`, issue 39's check in 7.5;
docs/gpu.md).

Each phase (blink.bench.gpu.phases) is a process of its own with its own timeout, cut to what is left of the
budget, and leaves its JSON before the next starts: a phase that hangs (a persistent loop that never yields, say)
loses nothing else. At the end: one JSON result naming the machine, and a short table, printed last.
`--dry-run` runs the same phases on the CPU over the tiny random model in the host mode (CI does, so this never
rots); the GPU-only parts say they were skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name: its own timeout in seconds, in the order a run without --phases or a profile takes them
PHASES = {"env": 90, "model-llama3-1b": 150, "parity": 150, "persistent": 90, "model-llama3-8b": 200,
          "model-llama3-8b-fp8": 150, "model-llama3-8b-kv-fp8": 120, "model-llama3-1b-compiled": 240,
          "model-qwen3-30b-a3b-24l": 200, "interference": 300, "kv-pressure": 300, "tests": 240}


# Named selections for one short device call: what each runs unless its own flags say otherwise.
PROFILES = {
    # Issue 39's check in at most 7.5 minutes, in the order of what it must find first: the ceilings; both Llama
    # shapes' captured steps (no host cells) at batch 1 and 256, greedy and mixed, with their kernel counts and
    # floors; parity across the modes (a prefix hit and a rotation included); every mode under CPU interference
    # with its energy per token; issue 43's 8B shape in FP8 and FP8 KV pages; then the kernel tests, which take what
    # is left (their log keeps what they reached: rerun `--phases tests` in a second call if the budget cut them).
    # Not the compiled bookkeeping: minutes of torch.compile that the budget never reached.
    "quick": {"phases": ["env", "model-llama3-1b", "model-llama3-8b", "parity", "interference",
                         "model-llama3-8b-fp8", "model-llama3-8b-kv-fp8", "tests"],
              "modes": ["graph", "persistent"], "batches": [1, 256], "budget_s": 450},
}
MODES = ("host", "graph", "persistent")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", choices=PROFILES, help="a named selection of phases, modes, batches and budget "
                   "(quick: issue 39's check in 7.5 minutes); the flags below override its parts")
    p.add_argument("--phases", nargs="+", choices=PHASES)
    p.add_argument("--modes", nargs="+", choices=MODES, help="drive modes the model phases time (default: every "
                   "mode that runs here); parity always compares against the host mode")
    p.add_argument("--batches", nargs="+", type=int, help="batches the model phases time (default 1 8 64 256)")
    p.add_argument("--budget-s", type=float, help="all phases together (a device call allows 600; default 540)")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, the tiny model, host mode only")
    p.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--compile-bookkeeping", action="store_true", help="every engine and server the phases start "
                   "compiles its step's bookkeeping (BLINK_COMPILE_BOOKKEEPING=1 in their environment; a server "
                   "asked for the host mode refuses it)")


def resolve(args: argparse.Namespace) -> dict:
    """The phases, modes, batches and budget this run uses: its flags, else its profile's, else the defaults."""
    profile = PROFILES.get(args.profile, {})
    chosen = {"phases": list(PHASES), "modes": None, "batches": None, "budget_s": 540} | profile
    given = {"phases": args.phases, "modes": args.modes, "batches": args.batches, "budget_s": args.budget_s}
    return chosen | {name: value for name, value in given.items() if value is not None}


def run(args: argparse.Namespace) -> None:
    from blink.bench.lib.machine import blink_source, machine, save

    chosen = resolve(args)
    deadline = time.monotonic() + chosen["budget_s"]
    phases: dict[str, dict] = {}
    selection = [*(["--modes", *chosen["modes"]] if chosen["modes"] else []),
                 *(["--batches", *map(str, chosen["batches"])] if chosen["batches"] else [])]
    with tempfile.TemporaryDirectory(prefix="blink-gpu-") as work:
        for name in chosen["phases"]:
            left = deadline - time.monotonic()
            if left < 20:
                phases[name] = {"status": "not run: the budget was spent"}
                continue
            phases[name] = _phase(name, Path(work), min(PHASES[name], left), args.dry_run, args.compile_bookkeeping,
                                  selection)
            print(f"{name}: {phases[name]['status']} ({phases[name].get('seconds', 0):.0f} s)", flush=True)
    result = {"benchmark": "gpu", "profile": args.profile, "selection": chosen, "dry_run": args.dry_run,
              "compile_bookkeeping": args.compile_bookkeeping, "machine": machine(), "blink": blink_source(),
              "phases": phases}
    if not args.no_save:
        print(f"saved {save('gpu', result, args.result_dir)}")
    print(summary(phases))


def _phase(name: str, work: Path, timeout_s: float, dry_run: bool, compile_bookkeeping: bool = False,
           selection: list[str] = ()) -> dict:
    cmd = [sys.executable, "-m", "blink.bench.gpu.phases", name, str(work), *(["--dry-run"] if dry_run else []),
           *selection]
    env = {**os.environ, "BLINK_COMPILE_BOOKKEEPING": "1"} if compile_bookkeeping else None
    started = time.monotonic()
    # Its own session, so a timeout kills what it started too (a server, interference workers).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        status = f"timed out after {timeout_s:.0f} s"
    path = work / f"{name}.json"
    found = json.loads(path.read_text()) if path.is_file() else {}
    log = Path(found.pop("log", ""))  # in `work`, which goes with the run
    if "summary" not in found and log.is_file():  # the tests, cut: what they reached
        from blink.bench.gpu.phases import tests_report

        found.update(tests_report(log.read_text(), whole=False))
    return {**found, "status": status, "seconds": time.monotonic() - started, "output_tail": output[-3000:]}


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def summary(phases: dict[str, dict]) -> str:
    """The short table: what ran, what it found, against the issue's goals."""
    lines = ["", f"{'phase':18s} {'status':28s} seconds"]
    lines += [f"{name:18s} {p['status'][:28]:28s} {p.get('seconds', 0):7.0f}" for name, p in phases.items()]
    env = phases.get("env", {})
    if gpu := env.get("gpu"):
        lines.append(f"\n{gpu['name']} (driver {gpu.get('driver')}), torch {env['versions']['torch']}, triton "
                     f"{env['versions']['triton']}: copy {env.get('copy_gb_s', 0):.0f} GB/s, read "
                     f"{env.get('read_gb_s', 0):.0f} GB/s, bf16 "
                     f"{env.get('bf16_matmul_tflops', 0):.0f} TFLOP/s; host register {env.get('host_register')}")
    if "modes" in env:
        lines.append(f"modes: {', '.join(env['modes'])}" + "".join(f"; {r}" for r in env["modes_unavailable"]))
    for name, p in phases.items():
        if name.startswith("model-") and "steps" in p:
            lines.append(f"\n{name[6:]}: ms per step at batch (tokens/s)"
                         + (f"; eager step syncs: {p['eager_step_syncs'][:60]}" if "eager_step_syncs" in p else ""))
            for mode, by_batch in p["steps"].items():
                cells = [f"{b}: {r['ms_per_step']:.2f} ({r['tokens_per_s']:.0f})"
                         + (f" mixed {r['mixed']['ms_per_step']:.2f}" if "mixed" in r else "")
                         for b, r in by_batch.items() if isinstance(r, dict) and "ms_per_step" in r]
                lines.append(f"  {mode:10s} " + ("  ".join(cells) or by_batch.get("error", "")[:100]))
                for b, r in by_batch.items():
                    if isinstance(r, dict) and "gpu_ms_per_step" in r.get("kernels", {}):
                        k = r["kernels"]
                        kinds = ", ".join(f"{name} {ms:.2f}" for name, ms in k["ms_per_step_by_kind"].items())
                        lines.append(f"    batch {b}: GPU {k['gpu_ms_per_step']:.2f} ms in {k['kernels_per_step']:.0f} "
                                     f"kernels per step over {k['steps']} steps traced ({k.get('steps_from')}; "
                                     f"the table counted {k.get('steps_counted')}) ({kinds}), idle "
                                     f"{k['idle_ms_per_step']:.2f} ms")
            if "floor_ms" in p:
                over = ", ".join(f"{m} {x:.2f}x" for m, x in p["batch1_over_floor"].items())
                lines.append(f"  batch-1 floor {p['floor_ms']:.2f} ms ({p['floor_bytes'] / 1e9:.2f} GB over "
                             f"{p['floor_bandwidth']}); measured over it: {over}")
            if "fp8_over_auto_ms_per_step" in p:  # the KV-pages phase: rows auto and fp8 above, in one mode
                lines.append(f"  {p['mode']}, batch {p['batch']}: FP8 KV pages take "
                             f"{p['fp8_over_auto_ms_per_step']:.2f}x the step time of the model dtype's")
            if "profile_ms" in p:
                lines.append("  eager step GPU ms: " + ", ".join(f"{k} {v:.3f}" for k, v in p["profile_ms"].items()))
    if against := phases.get("parity", {}).get("against_host"):
        for mode, r in against.items():
            cells = [f"{case} failed" for case in ("short", "mixed", "prefixed", "rotated") if r.get(f"{case}_error")]
            if "short_identical" in r:
                cells.append(f"short prompt identical {r['short_identical']}")
            for case, label in (("mixed", "mixed batch"), ("prefixed", "after a prefix hit"), ("rotated", "rotated")):
                if f"{case}_first_divergence" in r:
                    cells.append(f"{label} first divergence per request "
                                 f"{list(r[f'{case}_first_divergence'].values())}")
            if "mixed_teacher_forced_gap" in r:
                cells.append(f"largest teacher-forced gap to greedy {r['mixed_teacher_forced_gap']:.4f} nats")
            cells.append(f"prefix hit {r['prefix_hit']}, rotated out and back {r['rotated_out_and_back']} "
                         f"({phases['parity']['stats'].get(mode)})")
            lines.append(f"\nparity {mode} vs host: " + "; ".join(cells))
    if (p := phases.get("persistent", {})) and "conditional" in p:
        lines.append(f"\npersistent: {p['conditional']} nodes; restarts {p.get('restart')}; a sync from another "
                     f"thread while looping: {p.get('sync_while_running')}, after stop: {p.get('sync_after_stop')}")
    for mode, r in phases.get("interference", {}).get("runs", {}).items():
        if "throughput_kept" in r:
            lines.append(f"interference {mode}: throughput kept {r['throughput_kept']:.1%}, P99 TPOT x"
                         f"{r['p99_tpot_ratio']:.2f}, P99 TTFT x{r['p99_ttft_ratio']:.2f}"
                         + "".join(f"; J/token {c} {r[c]['joules_per_output_token']:.3f}" for c in ("isolated",
                                   "interference") if (r.get(c) or {}).get("joules_per_output_token"))
                         + (f"; constrained requests' P99 TPOT x{r['constrained_p99_tpot_ratio']:.2f}"
                            if "constrained_p99_tpot_ratio" in r else "")
                         + (f"; energy per token against host {r['energy_per_token_vs_host']}"
                            if "energy_per_token_vs_host" in r else ""))
    for mode, by_policy in phases.get("kv-pressure", {}).get("runs", {}).items():
        cells = []
        for policy, r in by_policy.items():
            ls = r.get("latency_sensitive", {})
            attained = [c.get("ttft_slo_attainment_all") for c in (r.get("latency_sensitive", {}),
                                                                    r.get("best_effort", {}))]
            cells.append(f"{policy}: TTFT SLO met ls {_percent(attained[0])} be {_percent(attained[1])}, ls P99 TTFT "
                         f"{ls.get('p99_ttft_ms') or 0:.0f} ms, {r.get('output_throughput') or 0:.0f} tok/s, "
                         f"{r.get('preemptions') or 0:.0f} preemptions")
        lines.append(f"kv pressure {mode}: " + "; ".join(cells))
    if "summary" in phases.get("tests", {}):
        lines.append(f"\ntests: {phases['tests']['summary']}")
        lines += [f"  {line}" for line in phases["tests"]["failed"][:20]]
    return "\n".join(lines)


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"
