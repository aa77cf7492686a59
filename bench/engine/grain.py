"""`blink bench grain`: what a best-effort prompt chunk in the same step costs the latency-sensitive decodes beside
it. QLLM (and Blink's `slo` policy) preempt at the step; issue 19 asks to measure before building a finer grain.

D latency-sensitive requests decode; each measured step runs their decodes alone, or beside a best-effort prompt
chunk of C tokens (a new request whose prefill the step takes whole). Alternated step by step, medians and the
spread over repeats: milliseconds per step, and the ratio to the decode-only step, which is the delay every
latency-sensitive token takes from sharing its step. A grain finer than the step would return those tokens after
the decodes alone, at the cost of a second launch for the chunk. The model defaults to a small random Qwen3-MoE
(`blink model init --arch qwen3-moe`); the engine runs where `--device` says, in the host loop, timed on the host
(on a GPU each step ends with the host's read of its tokens, so host timing is step timing there too). Prints,
saves JSON under bench/results, asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from blink.bench.lib.machine import blink_source, machine, save


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="a checkpoint (default: a small random Qwen3-MoE, written for the run)")
    p.add_argument("--device", default="auto")
    p.add_argument("--decodes", type=int, default=8, help="latency-sensitive requests decoding (D)")
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 128, 480], help="best-effort chunk sizes (C)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--no-save", action="store_true")


def run(args: argparse.Namespace) -> None:
    if args.model is not None:
        return _measure(args, args.model)
    from blink.engine.model.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="blink-bench-") as tmp:
        _measure(args, write_tiny_model(Path(tmp) / "tiny-moe", arch="qwen3-moe"))


def _measure(args: argparse.Namespace, model: Path) -> None:
    from blink.engine import LLM, SamplingParams
    from blink.shared.service_class import ServiceClass

    top = max(args.chunks)
    llm = LLM(str(model), device=args.device, max_num_seqs=args.decodes + 1,
              max_num_batched_tokens=args.decodes + top, max_model_len=top + 2 * args.repeats * len(args.chunks) + 64,
              swap_space=0)
    driver = llm._driver
    urgent = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True,
                            service_class=ServiceClass.LATENCY_SENSITIVE)
    for i in range(args.decodes):
        driver.add_request(f"ls{i}", [10 + i, 11, 12, 13], urgent, llm.engine.max_model_len - 8)
    for _ in range(3):  # their prefills, then decodes
        driver.step()
    chunk_params = SamplingParams(temperature=0, max_tokens=1, service_class=ServiceClass.BEST_EFFORT)
    times: dict[int, list[float]] = {c: [] for c in [0, *args.chunks]}
    for repeat in range(args.repeats):
        for c in times:
            if c:
                driver.add_request(f"be{repeat}-{c}", [(7 * i) % 900 + 5 for i in range(c)], chunk_params, 1)
            started = time.perf_counter()
            driver.step()
            times[c].append(time.perf_counter() - started)
            while len(driver._resident) > args.decodes:  # the chunk's request ends with its one token
                driver.step()
    alone = statistics.median(times[0])
    rows = [{"chunk": c, "median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t),
             "over_decode_only": statistics.median(t) / alone} for c, t in times.items()]
    print(f"{args.decodes} latency-sensitive decodes, {model.name} on {llm.engine.device}, {args.repeats} repeats:")
    for r in rows:
        print(f"  chunk {r['chunk']:4d}: {r['median_ms']:7.2f} ms per step [{r['min_ms']:.2f}, {r['max_ms']:.2f}], "
              f"{r['over_decode_only']:.2f}x the decodes alone")
    result = {"benchmark": "grain", "model": str(model), "device": str(llm.engine.device),
              "decodes": args.decodes, "repeats": args.repeats, "rows": rows, "machine": machine(),
              "blink": blink_source()}
    if not args.no_save:
        print(f"saved {save('grain', result, args.result_dir)}")
