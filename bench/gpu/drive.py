"""Running the drive modes over a slot table of their own, for `blink bench gpu`: Llama 3 shaped checkpoints with
random weights made on the GPU (`--load-format dummy`; only config.json and a tokenizer on disk), step times per
mode and batch, and greedy tokens per mode."""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
import uuid
from pathlib import Path

import torch
from pydantic import TypeAdapter

from blink.bench.engine.step import REQUESTS
from blink.engine.drive.driver import Driver
from blink.engine.drive.modes import build, candidates
from blink.engine.engine import Engine, EngineConfig
from blink.engine.model.checkpoint import FP8_PROJECTION
from blink.engine.model.dummy import tensor_shape
from blink.engine.model.model import checkpoint_tensor_names
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.slot_table import Request, SlotState, SlotTable

LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5,
          "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu", "torch_dtype": "bfloat16",
          "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
             "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "hidden_act": "silu",
             "torch_dtype": "bfloat16", "rope_scaling": None, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": []}
SHAPES = {  # Llama-3.2-1B, Llama-3.1-8B, and Qwen3-30B-A3B with half its 48 layers (31 GB of weights, not 61)
    "llama3-1b": {**LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True},
    "llama3-8b": {**LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
    "qwen3-30b-a3b-24l": {**QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                          "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                          "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
                          "moe_intermediate_size": 768},
}
ORDER = ("host", "graph", "persistent")


def drive_modes(dry_run: bool) -> list[str]:
    """The modes this machine runs, host first (the reference)."""
    if dry_run or not torch.cuda.is_available():
        return ["host"]
    runnable = candidates("auto", torch.device("cuda"))[0]
    return [m for m in ORDER if m in runnable]


def model_dir(shape: str, dry_run: bool) -> Path:
    """A checkpoint directory of `shape` without weights (the tiny model's tokenizer); the tiny model itself in a
    dry run."""
    default = ensure_tiny_model()
    if dry_run:
        return default
    target = Path(tempfile.gettempdir()) / f"blink-bench-{shape}"
    if not (target / "config.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        for f in default.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy(f, target / f.name)
        config = json.loads((default / "config.json").read_text())  # its token ids (bos, eos) stay
        config.update(SHAPES[shape])
        (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def engine_options(dry_run: bool) -> dict:
    # The variable `blink serve` reads too (shared.settings), read as its settings read it, so the phases that
    # start engines here and those that start servers agree.
    compiled = {"compile_bookkeeping": TypeAdapter(bool).validate_python(
        os.environ.get("BLINK_COMPILE_BOOKKEEPING") or "false"), "quantization": os.environ.get("BLINK_QUANTIZATION"),
        "kv_cache_dtype": os.environ.get("BLINK_KV_CACHE_DTYPE") or "auto"}
    if dry_run:
        return {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256,
                "swap_space": 0, **compiled}
    return {"load_format": "dummy", "dtype": "bfloat16", "max_num_seqs": 256, "max_num_batched_tokens": 512,
            "max_model_len": 1024, "swap_space": 0, **compiled}


def engine_for(directory: Path, dry_run: bool) -> Engine:
    return Engine(EngineConfig(model=str(directory), **engine_options(dry_run)))


def weight_bytes(engine: Engine, tokens: int | None = None) -> int:
    """The weights' bytes (tokens None), or what a decode step of `tokens` reads of them: top_k of a mixture's
    experts, and of an untied input embedding one row per token (a tied one is read whole as the output's)."""
    cfg = engine.model_config
    active = cfg.moe.top_k / cfg.moe.num_experts if cfg.moe else 1.0

    def elements(name: str) -> float:
        shape = torch.Size(tensor_shape(cfg, name))
        if tokens is not None and name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            return min(tokens, shape[0]) * shape[1]
        return shape.numel() * (active if tokens is not None and ".experts." in name else 1.0)

    def size(name: str) -> int:  # FP8 projections a byte a weight (their float32 scales: under 0.1% more)
        fp8 = engine.config.quantization == "fp8" and FP8_PROJECTION.fullmatch(name)
        return 1 if fp8 else cfg.dtype.itemsize

    return int(sum(elements(n) * size(n) for n in checkpoint_tensor_names(cfg)))


def _table(engine: Engine, window: int = 1024) -> SlotTable:
    return SlotTable.create(f"gpu-bench-{uuid.uuid4().hex[:8]}", engine.geometry(window, max_prompt_tokens=512))


def _prompt(slot: int, length: int = 16) -> list[int]:
    return [(7 * slot + 3 * i) % 500 + 10 for i in range(length)]


def step_times(directory: Path, dry_run: bool, mode: str, batches: list[int],
               mixed: list[int] = ()) -> dict[str, dict]:
    """Steady decode of `batch` greedy requests in `mode`: milliseconds per step (the table's step counter) and
    tokens per second (what a reader took), the medians of WINDOWS windows once every request has its first tokens,
    and the slowest and fastest window's step time; at the `mixed` batches, the same under `blink bench step`'s
    mixed requests (every other one sampled with each filter, penalties, logprobs and a bias), as `mixed`."""
    engine = engine_for(directory, dry_run)
    table = _table(engine)
    started = time.monotonic()
    driver = build(mode, engine, table)
    results: dict[str, dict] = {"start_s": time.monotonic() - started}
    try:
        driver.start()
        for batch in batches:
            # CUPTI delivers a kernel's record when its launch ends, and the persistent loop's never does.
            profiled = torch.cuda.is_available() and mode != "persistent" and batch in (batches[0], batches[-1])
            results[str(batch)] = _timed(driver, table, engine, batch, "greedy", profiled)
        for batch in mixed:
            results.setdefault(str(batch), {})["mixed"] = _timed(driver, table, engine, batch, "mixed", False)
    finally:
        _close(driver, table)
    return results


def _timed(driver: Driver, table: SlotTable, engine: Engine, batch: int, kind: str, profiled: bool) -> dict:
    """One batch of `kind` requests (bench/engine/step.py's REQUESTS) timed in steady decode, then cancelled."""
    slots = range(batch)
    for slot in slots:
        table.publish(slot, Request(_prompt(slot), engine.max_model_len - 64, ignore_eos=True, **REQUESTS[kind](slot)))
    _wait(driver, lambda: all(int(table.slots["produced"][s]) >= 2 for s in slots), 120)  # compiling, say
    for slot in slots:
        table.read(slot)
    windows = [_window(table, slots) for _ in range(WINDOWS)]
    step_ms = sorted(w[0] for w in windows)
    row = {"ms_per_step": statistics.median(step_ms), "ms_per_step_range": [step_ms[0], step_ms[-1]],
           "tokens_per_s": statistics.median(w[1] for w in windows)}
    if profiled:
        try:
            row["kernels"] = kernel_profile(table, slots, engine.model_config.num_layers)
        except Exception as e:  # the step times stand without it
            row["kernels"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    for slot in slots:
        table.cancel(slot)
    _wait(driver, lambda: all(table.slots["state"][s] == SlotState.FINISHED for s in slots), 30)
    for slot in slots:
        table.read(slot)
        table.free(slot)
    return row


WINDOWS, WINDOW_S = 3, 0.3


def _window(table: SlotTable, slots: range) -> tuple[float, float]:
    """Milliseconds per step and tokens per second over one window, reading as an ingress would."""
    t0, steps0, tokens = time.monotonic(), int(table.header["steps"]), 0
    while time.monotonic() < t0 + WINDOW_S:
        time.sleep(0.05)
        tokens += sum(len(table.read(slot).tokens) for slot in slots)
    seconds, steps = time.monotonic() - t0, int(table.header["steps"]) - steps0
    return 1e3 * seconds / max(steps, 1), tokens / seconds


KERNEL_KINDS = (  # by name: what a steady step's GPU time goes to
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "cublas")),
    ("attention, rope, norm, activation", ("_paged_attention", "_rope_and_cache", "_rms_norm", "_silu_and_mul")),
    ("exchange", ("_select", "_admit", "_emit", "_demand", "pick")),
)


# Kernels a step launches once (the demand it publishes last), then a layer's one (attention): the steps CUPTI traced
# are counted by them, not by the table's counter (CUPTI may trace fewer steps than the window ran: 55 of 62, 13
# of 20 in the first H100 run).
STEP_MARKERS = (("_demand", 1), ("_paged_attention_kernel", None))


def steps_traced(counts: dict[str, int], layers: int) -> tuple[int, str] | None:
    """How many steps a trace holds, by its marker kernels' launches (None: no marker in it)."""
    for name, per_step in STEP_MARKERS:
        if counts.get(name):
            return max(1, round(counts[name] / (per_step or layers))), f"{name} x{per_step or layers} a step"
    return None


def kernel_profile(table: SlotTable, slots: range, layers: int, seconds: float = 0.25) -> dict:
    """GPU time per step by kind of kernel over a window of steady steps (CUPTI sees every kernel, the ones
    graphs and the persistent loop launch included), per step traced (`steps_traced`), and the ten costliest
    kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    steps0 = int(table.header["steps"])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
            for slot in slots:
                table.read(slot)
    counted = int(table.header["steps"]) - steps0
    per_name: dict[str, list[float]] = {}
    spans = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
            spans.append((e.time_range.start, e.time_range.end, e.name))
    steps, steps_from = steps_traced({n: len(t) for n, t in per_name.items()}, layers) or (max(1, counted),
                                                                                           "the table's counter")
    kinds: dict[str, float] = {}
    for name, times in per_name.items():
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name.lower() for m in marks)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + sum(times) / steps / 1e3
    top = sorted(per_name.items(), key=lambda item: -sum(item[1]))[:10]
    idle, after = _idle(spans)
    return {"steps": steps, "steps_from": steps_from, "steps_counted": counted,
            "gpu_ms_per_step": sum(kinds.values()), "ms_per_step_by_kind": kinds,
            "idle_ms_per_step": idle / steps / 1e3,
            "idle_after": [{"name": n[:90], "ms_per_step": us / steps / 1e3} for n, us in after],
            "kernels_per_step": sum(len(t) for t in per_name.values()) / steps,
            "top": [{"name": n[:90], "per_step": len(t) / steps, "ms_per_step": sum(t) / steps / 1e3}
                    for n, t in top]}


def _idle(spans: list[tuple[float, float, str]]) -> tuple[float, list[tuple[str, float]]]:
    """Microseconds the GPU ran no kernel between the first and the last, and the five kernels most often
    followed by the idle time (a wait on mapped host memory, a dependency, a launch)."""
    idle, end, last, after = 0.0, None, "", {}
    for start, stop, name in sorted(spans):
        if end is not None and start > end:
            idle += start - end
            after[last] = after.get(last, 0.0) + start - end
        if end is None or stop > end:
            end, last = stop, name
    return idle, sorted(after.items(), key=lambda item: -item[1])[:5]


def greedy(directory: Path, dry_run: bool, mode: str, rounds: list[dict[int, list[int]]], n: int,
           stats: list | None = None, **options) -> list[dict[int, list]]:
    """Each round's prompts decoded greedily for `n` tokens, round after round on one engine (a later round may hit
    the prefix cache an earlier one filled), with `options` over engine_options; each finished request's
    RequestStats appended to `stats`."""
    engine = Engine(EngineConfig(model=str(directory), **(engine_options(dry_run) | options)))
    table = _table(engine)
    driver = build(mode, engine, table)
    try:
        return [drive_requests(driver, table, {slot: Request(p, n, temperature=0.0, ignore_eos=True)
                                               for slot, p in prompts.items()}, stats=stats) for prompts in rounds]
    finally:
        _close(driver, table)


def drive_requests(driver: Driver, table: SlotTable, requests: dict[int, Request], restarts: int = 0,
                   timeout_s: float = 120, stats: list | None = None) -> dict[int, list[int]]:
    """Publishes `requests`, runs the driver until all finished (stopping and restarting it `restarts` times with
    every request in flight), frees their slots; returns each one's tokens (and appends its stats to `stats`)."""
    for slot, request in requests.items():
        table.publish(slot, request)
    got: dict[int, list[int]] = {slot: [] for slot in requests}
    done: set[int] = set()
    driver.start()
    deadline, stops = time.monotonic() + timeout_s, 0
    while len(done) < len(requests):
        _alive(driver, deadline)
        time.sleep(0.002)
        for slot in set(requests) - done:
            out = table.read(slot)
            got[slot] += out.tokens
            if out.finish:
                done.add(slot)
                table.free(slot)
                if stats is not None:
                    stats.append(out.stats)
        if stops < restarts and min(len(t) for t in got.values()) >= 20 * (stops + 1):
            driver.stop()
            driver.start()
            stops += 1
    driver.stop()
    return got


def _wait(driver: Driver, condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        _alive(driver, deadline)
        time.sleep(0.002)


def _alive(driver: Driver, deadline: float) -> None:
    if driver.failure is not None:
        raise RuntimeError(f"the driver stopped: {driver.failure!r}") from driver.failure
    if time.monotonic() > deadline:
        raise TimeoutError(f"requests did not progress in time (resident {driver.resident})")


def _close(driver: Driver, table: SlotTable) -> None:
    driver.stop()
    driver.close()
    table.close()
    table.unlink()


def failure(e: BaseException, limit: int = 4000) -> str:
    """What failed, for a phase's JSON: the exception and the end of its traceback, its cause's included (a lent
    GPU's run is read afterwards, so the frame that failed must be in it)."""
    text = "".join(traceback.format_exception(e))
    return f"{type(e).__name__}: {e}"[:500] + "\n" + text[-(limit - 500):]


def free_memory() -> None:
    """What one engine held on the GPU given back before the next is made."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
