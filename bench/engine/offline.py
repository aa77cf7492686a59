"""Offline throughput: Blink's `LLM.generate` against transformers' `generate` on the same random Llama.

What it measures: the wall-clock time to finish a fixed batch of requests (mixed prompt and output lengths,
greedy, EOS ignored so every request produces exactly its requested number of tokens), reported as
requests/s, output tokens/s and total (prompt + output) tokens/s, with the ratio of Blink's output tokens/s
to transformers'.

How the baseline is batched: as in vLLM's `benchmark_throughput.py` HF backend, the requests are cut, in
order, into static batches of `--batch-size` prompts, left-padded (pad id 0, with an attention mask); each
batch generates until its longest request is done (`max_new_tokens = min_new_tokens = ` the longest requested
output in the batch), and only the requested output tokens count as useful. Blink gets the same requests all
at once and schedules them itself (continuous batching, `max_num_seqs = --batch-size`, a token budget of
`--max-num-batched-tokens` per step).

The checkpoint is a ~100M-parameter Llama with random float32 weights, built with transformers and saved
with `save_pretrained`; the tokenizer is the engine's small trained BPE (prompts are token ids, so its
vocabulary being smaller than the model's does not matter). The script prints figures and writes a JSON
file under bench/results/; it asserts nothing.

    blink bench offline            # the default run: about 6 minutes on 2 CPU cores
    blink bench offline --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers

from blink.bench.lib.machine import blink_source, machine, save

PROMPT_VOCAB = 1174  # prompt token ids are drawn below the engine tokenizer's vocabulary size
MODEL_SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
METRICS = ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s")


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class RunResult:
    system: str
    repeat: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    wrong_lengths: int  # requests whose output is not exactly the requested length (0 when all is well)


# ---------------------------------------------------------------- setup


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"),
                   help="prompt lengths are uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"),
                   help="output lengths are uniform in [MIN, MAX]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each system, alternating")
    p.add_argument("--batch-size", type=int, default=16, help="Blink's max_num_seqs and the baseline's batch size")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both systems run in it")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="Blink's token budget per step")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where to build (or reuse) the checkpoint; a temporary directory when not given")
    p.add_argument("--result-dir", type=Path, default=Path("."))
    p.add_argument("--label", default=None, help="free text saved with the results")
    p.add_argument("--quick", action="store_true",
                   help="a small smoke-test run: 16 requests, short prompts and outputs, one repeat")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def build_checkpoint(model_dir: Path, seed: int) -> None:
    """Writes a random float32 Llama and the engine's tokenizer into model_dir, unless one is already there."""
    from blink.engine.model.tiny_model import train_tokenizer

    if (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file():
        return
    seed_everything(seed)
    config = transformers.LlamaConfig(**MODEL_SHAPE, tie_word_embeddings=True, eos_token_id=None,
                                      bos_token_id=None)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(model_dir)
    train_tokenizer().save(str(model_dir / "tokenizer.json"))


def make_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(prompt=[rng.randrange(PROMPT_VOCAB) for _ in range(rng.randint(*prompt_len))],
                    output_len=rng.randint(*output_len)) for _ in range(n)]


def figures(system: str, repeat: int, requests: list[Request], elapsed: float, wrong: int) -> RunResult:
    out_tokens = sum(r.output_len for r in requests)
    total_tokens = out_tokens + sum(len(r.prompt) for r in requests)
    return RunResult(system, repeat, elapsed, len(requests) / elapsed, out_tokens / elapsed,
                     total_tokens / elapsed, wrong)


# ---------------------------------------------------------------- the two systems


class BlinkRunner:
    name = "blink"

    def __init__(self, model_dir: Path, batch_size: int, token_budget: int, dtype: str):
        from blink.engine import LLM

        self.llm = LLM(str(model_dir), max_num_seqs=batch_size, max_num_batched_tokens=token_budget, device="cpu",
                       dtype=dtype)

    def generate(self, requests: list[Request]) -> list[list[int]]:
        from blink.engine import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        outputs = self.llm.generate([r.prompt for r in requests], params)
        return [o.token_ids for o in outputs]


class TransformersRunner:
    name = "transformers"

    def __init__(self, model_dir: Path, batch_size: int, dtype: str):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.batch_size = batch_size

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())  # tied weights are counted once

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[list[int]]:
        outputs: list[list[int]] = []
        for start in range(0, len(requests), self.batch_size):
            outputs += self._generate_batch(requests[start:start + self.batch_size])
        return outputs

    def _generate_batch(self, batch: list[Request]) -> list[list[int]]:
        width = max(len(r.prompt) for r in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            attention_mask[i, width - len(r.prompt):] = 1
        new = max(r.output_len for r in batch)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                  max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        return [out[i, width:width + r.output_len].tolist() for i, r in enumerate(batch)]


def timed_run(runner: BlinkRunner | TransformersRunner, requests: list[Request],
              repeat: int) -> tuple[RunResult, list[list[int]]]:
    start = time.perf_counter()
    outputs = runner.generate(requests)
    elapsed = time.perf_counter() - start
    wrong = sum(len(o) != r.output_len for o, r in zip(outputs, requests, strict=True))
    return figures(runner.name, repeat, requests, elapsed, wrong), outputs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, int | float]:
    """How far greedy outputs agree: whole sequences, and the mean share of tokens before the first difference."""
    def prefix(x: list[int], y: list[int]) -> int:
        return next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))

    same = sum(x == y for x, y in zip(a, b, strict=True))
    shares = [prefix(x, y) / max(len(y), 1) for x, y in zip(a, b, strict=True)]
    return {"identical_requests": same, "of": len(a), "mean_common_prefix_share": statistics.fmean(shares)}


# ---------------------------------------------------------------- reporting


def summarize(runs: list[RunResult]) -> dict[str, dict[str, dict[str, float]]]:
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for system in ("blink", "transformers"):
        mine = [r for r in runs if r.system == system]
        summary[system] = {m: {"median": statistics.median(getattr(r, m) for r in mine),
                               "min": min(getattr(r, m) for r in mine),
                               "max": max(getattr(r, m) for r in mine)} for m in METRICS}
    return summary


def print_report(summary: dict, ratio: float, runs: list[RunResult], info: dict) -> None:
    w = info["workload"]
    print(f"\nmodel: {info['model']['parameters'] / 1e6:.1f}M parameters, float32, "
          f"{info['model']['num_hidden_layers']} layers, hidden {info['model']['hidden_size']}")
    print(f"workload: {w['num_requests']} requests, prompt {w['prompt_len']} tokens, output {w['output_len']} "
          f"tokens, seed {w['seed']}, batch {w['batch_size']}, Blink token budget {w['max_num_batched_tokens']}")
    src = info["blink_source"]
    state = {None: "", False: ", unmodified", True: ", with local changes"}[src["modified"]]
    print(f"blink: {src['path']} (commit {src['git_commit'] or 'unknown'}{state})")
    print(f"machine: {info['machine']['cpu_model']}, {info['machine']['torch_threads']} torch threads\n")
    for r in runs:
        flag = f"  ({r.wrong_lengths} outputs of the wrong length!)" if r.wrong_lengths else ""
        print(f"  run {r.repeat} {r.system:<12} {r.elapsed_s:7.2f} s  {r.output_tokens_per_s:8.1f} out tok/s{flag}")
    header = f"\n{'':<12} {'elapsed s':>22} {'requests/s':>22} {'output tok/s':>22} {'total tok/s':>22}"
    print(header + "\n" + " " * 12 + "   (median [min, max])" * 4)
    for system, metrics in summary.items():
        cells = [f"{m['median']:.3g} [{m['min']:.3g}, {m['max']:.3g}]" for m in metrics.values()]
        print(f"{system:<12} " + " ".join(f"{c:>22}" for c in cells))
    print(f"\nBlink / transformers, output tokens/s (ratio of medians): {ratio:.2f}x")
    a = info["greedy_agreement"]
    print(f"greedy outputs identical in {a['identical_requests']}/{a['of']} requests "
          f"(mean common prefix {a['mean_common_prefix_share']:.0%})")


# ---------------------------------------------------------------- main


def benchmark(args: argparse.Namespace, model_dir: Path) -> None:
    source = blink_source()  # before the runs, so later edits to the checkout are not attributed to them
    build_checkpoint(model_dir, args.seed)
    requests = make_workload(args.num_requests, args.prompt_len, args.output_len, args.seed)
    warmup = make_workload(2, (8, 16), (4, 4), args.seed + 1)

    blink = BlinkRunner(model_dir, args.batch_size, args.max_num_batched_tokens, args.dtype)
    hf = TransformersRunner(model_dir, args.batch_size, args.dtype)
    for runner in (blink, hf):
        runner.generate(warmup)

    runs: list[RunResult] = []
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for runner in (blink, hf):
            run, outputs[runner.name] = timed_run(runner, requests, repeat)
            runs.append(run)
            print(f"  run {repeat} {run.system:<12} {run.elapsed_s:.2f} s", flush=True)

    summary = summarize(runs)
    ratio = summary["blink"]["output_tokens_per_s"]["median"] / summary["transformers"]["output_tokens_per_s"]["median"]
    info = {
        "label": args.label,
        "machine": machine() | {"torch_threads": torch.get_num_threads()},
        "blink_source": source,
        "model": {**MODEL_SHAPE, "tie_word_embeddings": True, "dtype": args.dtype, "parameters": hf.num_parameters()},
        "workload": {"num_requests": args.num_requests, "prompt_len": list(args.prompt_len),
                     "output_len": list(args.output_len), "distribution": "uniform, inclusive",
                     "prompt_token_ids": f"uniform in [0, {PROMPT_VOCAB})", "seed": args.seed,
                     "batch_size": args.batch_size, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "prompt_tokens": sum(len(r.prompt) for r in requests),
                     "output_tokens": sum(r.output_len for r in requests), "quick": args.quick},
        "greedy_agreement": agreement(outputs["blink"], outputs["transformers"]),
    }
    print_report(summary, ratio, runs, info)
    result = {**info, "repeats": args.repeats, "runs": [asdict(r) for r in runs], "summary": summary,
              "ratio_output_tokens_per_s": ratio}
    print(f"\nsaved {save('offline_throughput', result, args.result_dir)}")


def on_checkpoint(model_dir: Path | None, benchmark: Callable[[Path], None]) -> None:
    """Runs `benchmark` on the random Llama in model_dir (built there if absent), else in a temporary directory."""
    if model_dir is not None:
        model_dir.mkdir(parents=True, exist_ok=True)
        benchmark(model_dir)
        return
    with tempfile.TemporaryDirectory(prefix="blink-bench-") as tmp:
        benchmark(Path(tmp) / "llama-125m")


def run(args: argparse.Namespace) -> None:
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len, args.repeats = 16, (8, 64), (4, 32), 1
    seed_everything(args.seed)
    on_checkpoint(args.model_dir, lambda model_dir: benchmark(args, model_dir))

