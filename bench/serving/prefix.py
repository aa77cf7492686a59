"""`blink bench prefix`: prefix caching on against off, the same build, side by side (issue 20).

Two `blink serve` processes on the same model, one with `--enable-prefix-caching` and one with
`--no-enable-prefix-caching`, loaded in alternation (the order flips every round) so that a noisy machine weighs on
both alike:

- `probe`: a fresh prefix of `--prefix-len` tokens with a question, then the same prefix with another question, one
  request at a time: TTFT cold and warm (the issue's goal: warm under 40% of cold on a CPU, 20% on a GPU).
- `multi_turn`: conversations whose every turn sends the whole history again (a system prompt, the earlier
  questions and the answers the server gave, a new question), one turn at a time: TTFT per turn.
- `load`: vLLM's `prefix_repetition` dataset (a few system prompts, each shared by many questions) at a request
  rate: TTFT P50/P99 and throughput.

Prompts are token ids through /v1/completions, so the lengths are exact; the usage of each answer says how many
prompt tokens the server found cached. Prints medians with their range, saves JSON under bench/results.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from pathlib import Path

import httpx

from blink.bench.lib.backends import OpenAIBackend, RequestOptions
from blink.bench.lib.dataset import load_tokenizer, prefix_repetition
from blink.bench.lib.figures import compute
from blink.bench.lib.loadgen import run_load
from blink.bench.lib.machine import blink_source, machine, save
from blink.bench.lib.server import running_server

SETTINGS = {"on": "--enable-prefix-caching", "off": "--no-enable-prefix-caching"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the tiny random model)")
    p.add_argument("--serve-flag", action="append", default=[], help="more `blink serve` flags, for both servers")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds of every phase")
    p.add_argument("--prefix-len", type=int, default=1500, help="tokens of the shared prefix (probe, load)")
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--turns", type=int, default=4, help="turns of a multi-turn conversation")
    p.add_argument("--system-len", type=int, default=512, help="tokens of a conversation's system prompt")
    p.add_argument("--num-prompts", type=int, default=24, help="requests of the load phase, per round")
    p.add_argument("--num-prefixes", type=int, default=3, help="system prompts the load's requests share")
    p.add_argument("--request-rate", type=float, default=2.0, help="of the load phase, requests per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", type=Path, default=Path("bench/results"))


def run(args: argparse.Namespace) -> Path:
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> Path:
    from blink.engine.model.tiny_model import ensure_tiny_model

    model = args.model or str(ensure_tiny_model())
    tokenizer = load_tokenizer(model, model)
    vocab = [i for i in range(tokenizer.get_vocab_size()) if i not in set(tokenizer.get_added_tokens_decoder())]
    rng = random.Random(args.seed)
    result = {"machine": machine(), "blink": blink_source(), "model": model, "args": _jsonable(vars(args)),
              "rounds": []}
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, \
            running_server(Path(a), "--model", model, SETTINGS["on"], *args.serve_flag, timeout_s=600) as on, \
            running_server(Path(b), "--model", model, SETTINGS["off"], *args.serve_flag, timeout_s=600) as off:
        servers = {"on": on.url, "off": off.url}
        served = await _models(on.url)
        path = None
        for r in range(args.rounds):
            round_ = {}
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                client = _Client(servers[name], served)
                try:
                    round_[name] = {"probe": await _probe(client, args, vocab, rng),
                                    "multi_turn": await _multi_turn(client, args, vocab, rng, tokenizer),
                                    "load": await _load(client, args, tokenizer, seed=args.seed * 1000 + r)}
                finally:
                    await client.aclose()
            result["rounds"].append(round_)
            result["summary"] = _summary(result["rounds"])
            path = save("prefix", result, args.result_dir, path)
    _print(result["summary"])
    print(f"saved {path}")
    return path


class _Client:
    """Completions with token-id prompts: one at a time (TTFT and the cached tokens of each), or a load."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.http = httpx.AsyncClient(timeout=600)
        self.backend = OpenAIBackend(url, RequestOptions(model, ignore_eos=True), chat=False)

    async def once(self, prompt: list[int], max_tokens: int) -> tuple[float, int, str]:
        """(TTFT in seconds, cached prompt tokens, the text) of one streamed request."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        loop = asyncio.get_running_loop()
        start, first, cached, text = loop.time(), None, 0, []
        async with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                if chunk.get("choices"):
                    first = first or loop.time()
                    text.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        return (first or loop.time()) - start, cached, "".join(text)

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.backend.aclose()


async def _probe(client: _Client, args, vocab: list[int], rng: random.Random) -> dict:
    prefix = rng.choices(vocab, k=args.prefix_len)
    cold = await client.once(prefix + rng.choices(vocab, k=args.question_len), args.output_len)
    warm = await client.once(prefix + rng.choices(vocab, k=args.question_len), args.output_len)
    return {"cold_ttft_ms": cold[0] * 1000, "warm_ttft_ms": warm[0] * 1000, "warm_cached_tokens": warm[1]}


async def _multi_turn(client: _Client, args, vocab: list[int], rng: random.Random, tokenizer) -> dict:
    history = rng.choices(vocab, k=args.system_len)
    turns = []
    for _ in range(args.turns):
        history += rng.choices(vocab, k=args.question_len)
        ttft, cached, answer = await client.once(history, args.output_len)
        turns.append({"prompt_tokens": len(history), "ttft_ms": ttft * 1000, "cached_tokens": cached})
        history += tokenizer.encode(answer, add_special_tokens=False).ids  # the client sends the answer back
    return {"turns": turns}


async def _load(client: _Client, args, tokenizer, seed: int) -> dict:
    samples = prefix_repetition(tokenizer, args.num_prompts, args.prefix_len, args.question_len, args.num_prefixes,
                                args.output_len, seed)
    records, duration = await run_load(client.backend, samples, args.request_rate, 1.0, seed, progress=False)
    figures = compute(records, duration, percentiles=(50, 99))
    return {k: figures[k] for k in ("completed", "failed", "p50_ttft_ms", "p99_ttft_ms", "output_throughput",
                                    "total_token_throughput")}


def _summary(rounds: list[dict]) -> dict:
    """Medians over rounds with their range, per setting, and the on/off ratios of each round."""
    figures = {
        "probe_cold_ttft_ms": lambda r: r["probe"]["cold_ttft_ms"],
        "probe_warm_ttft_ms": lambda r: r["probe"]["warm_ttft_ms"],
        "probe_warm_over_cold": lambda r: r["probe"]["warm_ttft_ms"] / r["probe"]["cold_ttft_ms"],
        "turn1_ttft_ms": lambda r: r["multi_turn"]["turns"][0]["ttft_ms"],
        "later_turns_ttft_ms": lambda r: statistics.mean(t["ttft_ms"] for t in r["multi_turn"]["turns"][1:]),
        "load_p50_ttft_ms": lambda r: r["load"]["p50_ttft_ms"],
        "load_p99_ttft_ms": lambda r: r["load"]["p99_ttft_ms"],
        "load_output_throughput": lambda r: r["load"]["output_throughput"],
    }
    out = {}
    for name, of in figures.items():
        for setting in SETTINGS:
            out.setdefault(name, {})[setting] = _spread([of(r[setting]) for r in rounds])
        if name != "probe_warm_over_cold":  # already a ratio on each server
            out[name]["on_over_off"] = _spread([of(r["on"]) / of(r["off"]) for r in rounds if of(r["off"])])
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def _print(summary: dict) -> None:
    print(f"{'figure':<26}{'on':>22}{'off':>22}{'on / off':>22}")
    for name, by in summary.items():
        cells = [f"{s['median']:.3g} [{s['min']:.3g}, {s['max']:.3g}]" if s else "-"
                 for s in (by["on"], by["off"], by.get("on_over_off"))]
        print(f"{name:<26}" + "".join(f"{c:>22}" for c in cells))


async def _models(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as http:
        return (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]


def _jsonable(values: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}
