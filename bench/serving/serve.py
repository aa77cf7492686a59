"""`blink bench serve`: a rate sweep against a server, with its figures printed as vLLM prints them and saved.

One JSON file per invocation: the configuration, the machine, the server's drive mode and transport (as its
/ready reports them), what interference ran, and one entry per request rate with every figure, the energy
where NVML can measure it, and each request's lengths, class, latencies and error. With --class-mix, each
request carries a service class (and its class's --class-slo), and each rate's entry has every class's figures
(bench/serving/classes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import signal
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import httpx

from blink.bench.lib.backends import Backend, OpenAIBackend, RequestOptions, RequestRecord, ZmqBackend, error_message
from blink.bench.lib.dataset import (
    LengthLimits,
    SampleRequest,
    load_tokenizer,
    prefix_repetition,
    random_tokens,
    sharegpt,
    synthetic,
)
from blink.bench.lib.energy import EnergyMeter
from blink.bench.lib.figures import LATENCIES, PERCENTILES, RequestTimes, compute, report
from blink.bench.lib.interference import Interference
from blink.bench.lib.loadgen import run_load
from blink.bench.lib.machine import blink_source, machine, save
from blink.bench.serving import structured
from blink.bench.serving.classes import MergeSlos, assign, class_figures, class_report, parse_mix, parse_slo
from blink.shared.cpus import parse_cpus

BACKENDS = ("openai", "openai-chat", "blink-zmq", "vllm")  # vllm: vLLM's name for the completions backend
ENDPOINTS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}
DATASETS = ("synthetic", "sharegpt", "random", "prefix_repetition")
CHECK_TIMEOUT_S = 120.0
SPECIAL_TOKEN_ROOM = 8  # tokens a server may add to a prompt (BOS, a chat template's markers)
SLO_NAMES = ("ttft", "tpot", "e2el")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions; blink-zmq: Blink's ZeroMQ API")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (also read for its model and "
                   "/ready with --backend blink-zmq)")
    p.add_argument("--zmq-endpoint", help="for --backend blink-zmq (default: the ZeroMQ API of the deployment that "
                   "BLINK_DEPLOYMENT and BLINK_RUNTIME_DIR name, on this host)")
    p.add_argument("--model", help="the model to request (default: the server's first in /v1/models)")
    p.add_argument("--tokenizer", help="tokenizer.json or checkpoint dir for prompt lengths (default: the served "
                   "model's, when it is a directory or Blink's default model)")
    p.add_argument("--api-key")
    p.add_argument("--dataset", "--dataset-path", dest="dataset", type=Path,
                   help="a ShareGPT-format JSON file (implies --dataset-name sharegpt)")
    p.add_argument("--dataset-name", choices=DATASETS, help="synthetic (the default without a file: ShareGPT-like "
                   "lengths, random tokens), sharegpt, random or prefix_repetition (vLLM's)")
    p.add_argument("--num-prompts", type=_positive(int), default=200)
    p.add_argument("--input-len", type=_positive(int), help="fixed prompt length (synthetic only)")
    p.add_argument("--output-len", type=_positive(int), help="fixed output length, instead of the dataset's")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-total-len", type=int, default=2048, help="also capped by the server's max_model_len")
    p.add_argument("--request-rate", type=_rates, default=[math.inf],
                   help="requests/s, or a sweep: 1,2,4,8,inf (default inf: all at once)")
    p.add_argument("--burstiness", type=_positive(float), default=1.0,
                   help="gamma shape of the arrival gaps; 1 is Poisson")
    p.add_argument("--max-concurrency", type=_positive(int))
    p.add_argument("--ignore-eos", action="store_true", help="every request generates exactly its output length")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-timeout", type=_positive(float), default=600.0,
                   help="seconds before a request counts as failed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--class-mix", type=parse_mix, metavar="CLASS:WEIGHT,...",
                   help="send each request with a service class drawn from --seed, e.g. ls:0.2,be:0.8 (ls, be, "
                   "latency_sensitive, best_effort; weights normalised), and report each class's figures")
    p.add_argument("--class-slo", nargs="+", type=parse_slo, action=MergeSlos, default={},
                   metavar="CLASS:METRIC=MS,...", help="per-class SLOs sent with each request of the class and "
                   "judged in its figures, e.g. ls:ttft=500,tpot=50 be:ttft=5000 (needs --class-mix)")
    structured.add_arguments(p)
    p.add_argument("--interference", type=_positive(int), metavar="N", help="CPU interference processes")
    p.add_argument("--interference-cpus", type=_cpus, help="pin them: 0,1 or 0-3")
    p.add_argument("--energy", action=argparse.BooleanOptionalAction, default=True, help="NVML energy per token")
    p.add_argument("--label", help="names this result set in plots (default: drive mode, transport, interference)")
    p.add_argument("--result-dir", type=Path, default=Path("."))
    p.add_argument("--disable-tqdm", action="store_true")
    vllm = p.add_argument_group("vLLM's `bench serve` flags (the same names and meanings)")
    vllm.add_argument("--host", help="the server's host (with --port: instead of --base-url)")
    vllm.add_argument("--port", type=_positive(int))
    vllm.add_argument("--endpoint", choices=ENDPOINTS, help="picks the backend: completions or chat")
    vllm.add_argument("--random-input-len", type=_positive(int), default=1024)
    vllm.add_argument("--random-output-len", type=_positive(int), default=128)
    vllm.add_argument("--random-range-ratio", type=float, default=0.0)
    vllm.add_argument("--random-prefix-len", type=int, default=0)
    vllm.add_argument("--prefix-repetition-prefix-len", type=_positive(int), default=256)
    vllm.add_argument("--prefix-repetition-suffix-len", type=_positive(int), default=256)
    vllm.add_argument("--prefix-repetition-num-prefixes", type=_positive(int), default=10)
    vllm.add_argument("--prefix-repetition-output-len", type=_positive(int), default=128)
    vllm.add_argument("--logprobs", type=int, help="top logprobs to ask for with each token")
    vllm.add_argument("--percentile-metrics", default=",".join(LATENCIES),
                      help="latencies to report: ttft,tpot,itl,e2el")
    vllm.add_argument("--metric-percentiles", default=",".join(map(str, PERCENTILES)), help="e.g. 50,90,99")
    vllm.add_argument("--save-result", action="store_true", help="results are always saved (under --result-dir)")
    vllm.add_argument("--save-detailed", action="store_true",
                      help="also each request's lengths, TTFT, ITLs and error under vLLM's keys")
    vllm.add_argument("--result-filename", help="the file's name in --result-dir (default: serve-TIME.json)")
    vllm.add_argument("--append-result", action="store_true",
                      help="append to --result-filename as a JSON line instead of rewriting it")
    vllm.add_argument("--metadata", nargs="+", default=[], metavar="KEY=VALUE", help="saved with the result")


def resolve_vllm_flags(args: argparse.Namespace) -> None:
    """vLLM's spellings onto Blink's: the server's address, the backend, the dataset, the figures wanted."""
    if args.host or args.port:
        args.base_url = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    if args.endpoint:
        args.backend = ENDPOINTS[args.endpoint]
    if args.backend == "vllm":
        args.backend = "openai"
    args.dataset_name = args.dataset_name or ("sharegpt" if args.dataset else "synthetic")
    if (args.dataset_name == "sharegpt") != bool(args.dataset):
        raise SystemExit("--dataset-name sharegpt reads --dataset-path, and only it does")
    args.percentile_metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    if unknown := set(args.percentile_metrics) - set(LATENCIES):
        raise SystemExit(f"--percentile-metrics: unknown {sorted(unknown)}; known: {','.join(LATENCIES)}")
    try:
        args.metric_percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise SystemExit("--metric-percentiles: numbers, e.g. 50,90,99") from None
    if any(not 0 <= p <= 100 for p in args.metric_percentiles):
        raise SystemExit("--metric-percentiles must be in [0, 100]")
    if any("=" not in item for item in args.metadata):
        raise SystemExit("--metadata takes KEY=VALUE pairs")
    if args.append_result and not args.result_filename:
        raise SystemExit("--append-result appends to --result-filename")


def run(args: argparse.Namespace) -> Path:
    """SIGTERM stops a run as ^C does: the interference processes are stopped before the process exits."""
    resolve_vllm_flags(args)
    if args.dataset and args.input_len:
        raise SystemExit("--input-len applies to synthetic prompts; a --dataset brings its own")
    goodput = parse_goodput(args.goodput)
    if args.class_slo and not args.class_mix:
        raise SystemExit("--class-slo judges the classes of --class-mix; without a mix, requests have no class")
    if args.backend == "blink-zmq" and args.zmq_endpoint is None:
        from blink.shared.settings import Settings

        args.zmq_endpoint = Settings().zmq_endpoint  # this host's deployment, as its services name it
    signal.signal(signal.SIGTERM, _interrupt)
    load = Interference(args.interference, args.interference_cpus) if args.interference else nullcontext()
    with load:
        return asyncio.run(sweep(args, goodput, load if args.interference else None))


async def sweep(args: argparse.Namespace, goodput: dict[str, float], load: Interference | None) -> Path:
    server = await server_info(args.base_url, args.api_key)
    model = args.model or server.get("model")
    if model is None:
        raise SystemExit(f"{args.base_url}/v1/models: {server.get('error')}" if server.get("error", "").startswith(
            "HTTP") else f"{args.base_url}: no model in /v1/models ({server.get('error')}); pass --model")
    tokenizer = load_tokenizer(args.tokenizer, model)
    # The server adds special tokens (BOS, a chat template) to what the client counts: leave them room.
    limits = LengthLimits(args.max_prompt_len, min(args.max_total_len,
                                                   (server.get("max_model_len") or math.inf) - SPECIAL_TOKEN_ROOM))
    samples = draw(args, tokenizer, limits)
    if args.class_mix:
        samples = assign(samples, args.class_mix, args.seed)
    if args.structured_output_ratio:
        samples = structured.assign(samples, args.structured_output_ratio, args.structured_output, args.seed)
    options = RequestOptions(model, args.temperature, args.ignore_eos, args.request_timeout, args.class_slo,
                             args.logprobs)
    backend: Backend = (ZmqBackend(args.zmq_endpoint, options, args.api_key) if args.backend == "blink-zmq" else
                        OpenAIBackend(args.base_url, options, args.backend == "openai-chat", args.api_key))
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "label": args.label or default_label(server, model, args.base_url, load),
        "backend": args.backend, "base_url": args.base_url,
        "zmq_endpoint": args.zmq_endpoint if args.backend == "blink-zmq" else None, "model_id": model,
        "dataset_name": args.dataset_name, "dataset": str(args.dataset) if args.dataset else None,
        "tokenizer_id": args.tokenizer or model, "num_prompts": len(samples),
        "input_len": args.input_len, "output_len": args.output_len, "ignore_eos": args.ignore_eos,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
        "goodput_slos_ms": goodput or None, "class_mix": args.class_mix, "class_slos_ms": args.class_slo or None,
        "structured_output_ratio": args.structured_output_ratio or None,
        "structured_output": args.structured_output if args.structured_output_ratio else None,
        "server": server, "interference": load.describe() if load else None,
        "machine": machine(), "blink": blink_source(), "runs": [], "complete": False,
        **dict(item.split("=", 1) for item in args.metadata)}
    path = args.result_dir / args.result_filename if args.result_filename and not args.append_result else None
    try:
        await check_server(backend, samples[0])
        for rate in args.request_rate:
            run = await one_rate(args, backend, samples, rate, goodput)
            result["runs"].append(run)
            result["complete"] = len(result["runs"]) == len(args.request_rate)
            # vLLM's keys at the top level too, the latest rate's: its tools read one run per file.
            result |= {"request_rate": run["request_rate"],
                       **{k: v for k, v in run.items() if k not in ("requests", "classes", "structured", "energy")}}
            if not args.append_result:  # after every rate: an interrupted sweep keeps some
                path = save("serve", result, args.result_dir, path)
    finally:
        await backend.aclose()
    if args.append_result:
        path = args.result_dir / args.result_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:  # JSON lines, as vLLM appends
            f.write(("\n" if f.tell() else "") + json.dumps(result))
    print(f"saved {path}")
    return path


def draw(args: argparse.Namespace, tokenizer, limits: LengthLimits) -> list[SampleRequest]:
    name, n, seed = args.dataset_name, args.num_prompts, args.seed
    if name == "sharegpt":
        return sharegpt(args.dataset, tokenizer, n, limits, seed, args.output_len)
    if name == "random":
        return random_tokens(tokenizer, n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                             seed, args.random_prefix_len)
    if name == "prefix_repetition":
        return prefix_repetition(tokenizer, n, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                 args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, seed)
    return synthetic(tokenizer, n, limits, seed, args.input_len, args.output_len)


async def one_rate(args: argparse.Namespace, backend: Backend, samples: list[SampleRequest], rate: float,
                   goodput: dict[str, float]) -> dict[str, object]:
    meter = EnergyMeter() if args.energy else None
    with meter or nullcontext():
        records, duration = await run_load(backend, samples, rate, args.burstiness, args.seed, args.max_concurrency,
                                           progress=not args.disable_tqdm)
    figures = compute(records, duration, goodput, args.metric_percentiles)
    energy = meter.result(int(figures["total_output_tokens"])) if meter else {"available": False,
                                                                            "reason": "--no-energy"}
    extra = {"Energy per output token (J/tok)": energy["joules_per_output_token"]} if energy["available"] else {}
    print(report(figures, rate, args.max_concurrency, extra, args.percentile_metrics, args.metric_percentiles),
          flush=True)
    classes = class_figures(records, duration, args.class_slo) if args.class_mix else None
    for name, figures_of_class in (classes or {}).items():
        print(class_report(name, figures_of_class), flush=True)
    groups = structured.figures(records, duration) if args.structured_output_ratio else None
    for name, figures_of_group in (groups or {}).items():
        print(class_report(name, figures_of_group, heading="Requests"), flush=True)
    detailed = {"input_lens": [r.prompt_len for r in records], "output_lens": [r.output_len for r in records],
                "ttfts": [(r.chunk_times[0] - r.start) if r.ok else None for r in records],
                "itls": [list(RequestTimes.of(r).itls) if r.ok else [] for r in records],
                "errors": [r.error or "" for r in records]} if args.save_detailed else {}
    return {"request_rate": rate if math.isfinite(rate) else "inf", **figures, "energy": energy,
            **({"classes": classes} if classes is not None else {}),
            **({"structured": groups} if groups is not None else {}), **detailed,
            "requests": [request_row(r) for r in records]}


def request_row(r: RequestRecord) -> dict[str, object]:
    times = RequestTimes.of(r) if r.ok else None
    return {"prompt_len": r.prompt_len, "output_len": r.output_len, "service_class": r.service_class,
            "constrained": r.constrained, "error": r.error,
            "ttft_ms": times.ttft * 1000 if times else None, "e2el_ms": times.e2el * 1000 if times else None,
            "chunks": len(r.chunk_times)}


async def check_server(backend: Backend, sample: SampleRequest) -> None:
    """One request before the run, so that a misconfigured run stops with the server's reason, not 200 failures."""
    print("checking the server with one request...", flush=True)
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            # with the sample's class and SLOs: a server that refuses them says so now
            record = await backend(dataclasses.replace(sample, output_len=min(sample.output_len, 4)))
    except TimeoutError:
        raise SystemExit(f"the server did not answer a test request within {CHECK_TIMEOUT_S} s") from None
    if not record.ok:
        raise SystemExit(f"the test request failed: {record.error}")


async def server_info(base_url: str, api_key: str | None) -> dict[str, object]:
    """The model and limits from /v1/models; drive mode, transport and scheduling from /ready, where the server is
    Blink."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info: dict[str, object] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=10, headers=headers) as client:
        try:
            response = await client.get("/v1/models")
            if response.status_code != 200:  # said as what it is: a 401 is a missing key, not a missing model
                info["error"] = f"HTTP {response.status_code}: {error_message(response.text)}"
                return info
            models = response.json()["data"]
            info |= {"model": models[0]["id"], "max_model_len": models[0].get("max_model_len")}
            ready = await client.get("/ready")
            if "application/json" in ready.headers.get("content-type", ""):
                body = ready.json()
                keys = ("drive", "transport", "degraded", "scheduling_policy", "kv_host_pages")
                info |= {k: body.get(k) for k in keys}
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            info["error"] = f"{type(e).__name__}: {e}"
    return info


def default_label(server: dict[str, object], model: str, base_url: str, load: Interference | None) -> str:
    """Blink's drive mode and transport; for another server, its model and address."""
    label = f"{server['drive']}/{server['transport']}" if server.get("drive") else f"{model} at {base_url}"
    return label + (f" +{load.processes} interference" if load else "")


def parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_NAMES or not value:
            raise SystemExit(f"--goodput {item!r}: want NAME:MS with NAME one of {', '.join(SLO_NAMES)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise SystemExit(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return slos


def _rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",")]  # float() reads "inf"
    if not all(r > 0 for r in rates):  # also refuses nan
        raise argparse.ArgumentTypeError("request rates must be positive numbers or inf")
    return rates


def _cpus(text: str) -> list[int]:
    try:
        return parse_cpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text}: must be positive")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signum)
