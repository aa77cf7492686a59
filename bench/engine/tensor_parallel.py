"""`blink bench tp`: decode with the model split over N ranks against one rank, side by side in one process.

The same greedy requests (EOS ignored, so every one makes its tokens) run through `LLM(model)` and
`LLM(model, tensor_parallel_size=N)`, alternated, repeated: seconds per run, output tokens per second, and the
ratio. On a CPU the ranks share the host's cores (each takes its share of the torch threads), so the figure says
what the collectives and the split cost, not a speed-up; on GPUs each rank has its own. The model: a checkpoint
(`--model`) or the ~100M random Llama `blink bench offline` builds. Prints, saves JSON, asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from blink.bench.lib.machine import blink_source, machine, save


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="a checkpoint (default: the random Llama of `blink bench offline`)")
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto: the checkpoint's, bfloat16 on a CPU that has it")
    p.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--no-save", action="store_true")


def run(args: argparse.Namespace) -> None:
    if args.model is not None:
        return _measure(args, args.model)
    from blink.bench.engine.offline import build_checkpoint, on_checkpoint

    def measure(model_dir: Path) -> None:
        build_checkpoint(model_dir, 0)
        _measure(args, model_dir)

    on_checkpoint(None, measure)


def _measure(args: argparse.Namespace, model: Path) -> None:
    from blink.engine import LLM, SamplingParams
    from blink.engine.device import configure_threads

    options = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                   max_num_batched_tokens=max(64, args.batch), max_model_len=args.prompt_len + args.output_len + 16,
                   swap_space=0)
    systems = {"1 rank": LLM(str(model), **options),
               f"{args.tensor_parallel_size} ranks": LLM(str(model), tensor_parallel_size=args.tensor_parallel_size,
                                                          **options)}
    prompts = [[(31 * b + 7 * i) % 900 + 5 for i in range(args.prompt_len)] for b in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    tokens = {}
    try:
        for llm in systems.values():
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm
        for _ in range(args.repeats):
            for (name, llm), ranks in zip(systems.items(), (1, args.tensor_parallel_size), strict=True):
                configure_threads(ranks)  # process-wide: each system runs with its own share of the cores
                started = time.perf_counter()
                tokens[name] = [o.token_ids for o in llm.generate(prompts, params)]
                seconds[name].append(time.perf_counter() - started)
    finally:
        for llm in systems.values():
            llm.close()
    output = args.batch * args.output_len
    rows = {name: {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s),
                   "output_tokens_per_s": output / statistics.median(s)} for name, s in seconds.items()}
    names = list(systems)
    ratio = rows[names[1]]["output_tokens_per_s"] / rows[names[0]]["output_tokens_per_s"]
    same = tokens[names[0]] == tokens[names[1]]
    dtype = str(systems["1 rank"].engine.model_config.dtype).removeprefix("torch.")
    print(f"{args.batch} requests x {args.output_len} tokens after {args.prompt_len}, {model.name} in {dtype} on "
          f"{args.device}, {args.repeats} alternated repeats:")
    for name, r in rows.items():
        print(f"  {name:8s} {r['median_s']:.2f} s [{r['min_s']:.2f}, {r['max_s']:.2f}], "
              f"{r['output_tokens_per_s']:.1f} output tok/s")
    # In 16-bit types the ranks' partial sums round differently from one rank's sums: greedy tokens may part.
    print(f"  {names[1]} / {names[0]}: {ratio:.2f}x the throughput; the same tokens: {same}")
    result = {"benchmark": "tensor_parallel", "model": str(model), "device": args.device, "dtype": dtype,
              "batch": args.batch,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "repeats": args.repeats, "rows": rows,
              "ratio": ratio, "same_tokens": same, "machine": machine(),
              "blink": blink_source()}
    if not args.no_save:
        print(f"saved {save('tensor_parallel', result, args.result_dir)}")
