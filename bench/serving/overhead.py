"""Serving overhead: generated tokens/s through `blink serve` (HTTP streaming) against the offline engine.

Same workload, same engine settings, same model (the default random one unless --model), in one run:
the server's run sends every request at once as a streaming /v1/completions call and counts the tokens the
client receives until the last stream ends; the offline run hands the same requests to `LLM.generate`. The
ratio server/offline is the share of the engine's throughput the serving path keeps. Prints, saves JSON
under bench/results/, asserts nothing.

    blink bench overhead [--num-requests 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from blink.bench.lib.machine import blink_source, machine, save
from blink.bench.lib.server import running_server

PROMPT_WORDS = ["the", "engine", "admits", "requests", "plans", "a", "batch", "and", "writes", "tokens", "back",
                "into", "slots"]


def workload(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choices(PROMPT_WORDS, k=rng.randint(4, 120))), rng.randint(16, 128)) for _ in range(n)]


async def through_http(url: str, model: str, requests: list[tuple[str, int]]) -> tuple[float, int]:
    async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        return tokens

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(requests))) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p, m) for p, m in requests))
        return time.perf_counter() - start, sum(counts)


def offline(llm, requests: list[tuple[str, int]]) -> tuple[float, int]:
    from blink.engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the built-in random model)")
    parser.add_argument("--result-dir", type=Path, default=Path("."))


def run(args: argparse.Namespace) -> None:
    from blink.engine import LLM
    from blink.engine.model.tiny_model import ensure_tiny_model

    model_dir = args.model or ensure_tiny_model()
    requests = workload(args.num_requests, args.seed)
    source = blink_source()
    llm = LLM(str(model_dir), max_num_seqs=args.max_num_seqs)
    offline(llm, requests)  # warm-up: every shape the timed runs meet, in both paths
    runs = {"server": [], "offline": []}
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--model", str(model_dir)]
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp), *flags) as server:
        asyncio.run(through_http(server.url, model_dir.name, requests))
        for repeat in range(args.repeats):
            for name in ("server", "offline"):
                if name == "server":
                    elapsed, tokens = asyncio.run(through_http(server.url, model_dir.name, requests))
                else:
                    elapsed, tokens = offline(llm, requests)
                runs[name].append({"elapsed_s": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed})
                print(f"  run {repeat} {name:<8} {elapsed:6.2f} s  {tokens / elapsed:8.1f} tok/s", flush=True)

    summary = {name: {"median": statistics.median(r["tokens_per_s"] for r in rs),
                      "min": min(r["tokens_per_s"] for r in rs), "max": max(r["tokens_per_s"] for r in rs)}
               for name, rs in runs.items()}
    ratio = summary["server"]["median"] / summary["offline"]["median"]
    for name, s in summary.items():
        print(f"{name:<8} {s['median']:8.1f} tok/s median  [{s['min']:.1f}, {s['max']:.1f}]")
    print(f"server / offline (ratio of medians): {ratio:.2f}")
    result = {"machine": machine(), "blink_source": source, "model": model_dir.name, "device": str(llm.engine.device),
              "workload": {"num_requests": args.num_requests, "prompt_words": [4, 120], "output_tokens": [16, 128],
                           "seed": args.seed, "max_num_seqs": args.max_num_seqs, "transport": "shm", "drive": "host"},
              "runs": runs, "summary": summary, "ratio_server_over_offline": ratio}
    print(f"saved {save('serving_overhead', result, args.result_dir)}")
