"""`blink bench startup`: seconds from `blink serve` to a ready server (`/ready` 200) and to its first chat answer,
for the default model or `--model`: a cold start (an empty cache: the model fetched and converted, the CPU kernels
built) when asked, then `--runs` warm ones. Prints medians and the spread, saves JSON with the machine, asserts
nothing.

    blink bench startup                # five warm starts of the default model
    blink bench startup --cold         # and first a cold one, in a fresh cache directory
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from blink.bench.lib.machine import blink_source, machine, save

SERVING = re.compile(r"blink serving at (http://\S+)/v1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="what to serve (default: the default model)")
    p.add_argument("--runs", type=int, default=5, help="warm starts")
    p.add_argument("--cold", action="store_true", help="first a start in an empty cache directory")
    p.add_argument("--serve-flag", action="append", default=[], help="more `blink serve` flags")
    p.add_argument("--timeout", type=float, default=600, help="seconds a start may take")
    p.add_argument("--result-dir", type=Path, default=Path("."))


def one_start(args: argparse.Namespace, env: dict[str, str], runtime: Path) -> dict[str, float]:
    """Seconds to the `blink serving at` line, to /ready 200, and to a chat answer."""
    cmd = [sys.executable, "-m", "blink.services.cli", "serve", "--port", "0", "--runtime-dir", str(runtime),
           "--deployment", f"startup-{os.getpid()}", *(["--model", args.model] if args.model else []),
           *args.serve_flag]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        url = None
        for line in proc.stdout:
            if match := SERVING.search(line):
                url, serving = match.group(1), time.perf_counter() - start
                break
        if url is None:
            raise SystemExit(f"blink serve exited ({proc.wait()}) before serving: run it alone to see why")
        while httpx.get(f"{url}/ready", timeout=5).status_code != 200:
            if time.perf_counter() - start > args.timeout:
                raise SystemExit(f"not ready within {args.timeout} s")
            time.sleep(0.05)
        ready = time.perf_counter() - start
        model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=args.timeout, json={
            "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello!"}]})
        r.raise_for_status()
        return {"serving_s": serving, "ready_s": ready, "first_answer_s": time.perf_counter() - start}
    finally:
        proc.terminate()
        proc.wait(60)


def run(args: argparse.Namespace) -> None:
    samples: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="blink-startup-") as tmp:
        env = dict(os.environ)
        if args.cold:
            env["BLINK_CACHE_DIR"] = str(Path(tmp) / "cache")  # kept for the warm starts after it
            samples["cold"].append(one_start(args, env, Path(tmp)))
            print(f"cold start: {samples['cold'][0]}", flush=True)
        for i in range(args.runs):
            samples["warm"].append(one_start(args, env, Path(tmp)))
            print(f"warm start {i}: {samples['warm'][-1]}", flush=True)
    medians = {figure: statistics.median(s[figure] for s in samples["warm"]) for figure in samples["warm"][0]}
    for figure, value in medians.items():
        spread = [s[figure] for s in samples["warm"]]
        print(f"  warm {figure:<15} {value:7.2f} s  [{min(spread):.2f}, {max(spread):.2f}]")
    result = {"machine": machine(), "blink": blink_source(), "model": args.model or "default",
              "serve_flags": args.serve_flag, "samples": samples, "warm_medians": medians}
    print(f"saved {save('startup', result, args.result_dir)}")
