"""The phases of `blink bench gpu` (blink.bench.gpu.gpu), each in a process of its own:
`python -m blink.bench.gpu.phases PHASE OUT_DIR [--dry-run]` writes OUT_DIR/PHASE.json, so a phase that hangs or
breaks its CUDA context loses nothing the others found.

A dry run (the CPU, in CI) runs the same code on the tiny random model in the host mode, so the command never rots.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import uuid
from importlib import metadata
from pathlib import Path

import torch

from blink.bench.gpu.drive import (
    drive_modes,
    drive_requests,
    engine_for,
    failure,
    free_memory,
    model_dir,
    step_times,
    weight_bytes,
)
from blink.bench.gpu.interference import interference
from blink.bench.gpu.parity import parity
from blink.bench.gpu.pressure import kv_pressure

SHAPES = ("llama3-1b", "llama3-8b", "qwen3-30b-a3b-24l")  # bench/gpu/drive.py's, in the order the phases run


def env(out: dict, dry_run: bool) -> None:
    """Versions, the GPU, `blink doctor`, which modes start and why not, host registration, the two ceilings."""
    from blink.engine.drive.modes import candidates
    from blink.engine.drive.table_memory import TableMemory
    from blink.shared.slot_table import Geometry, SlotTable

    out["versions"] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                       **{name: _version(name) for name in ("triton", "cuda-bindings", "cuda-python", "blink-serve")}}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":  # first: every model phase's floor reads it, whatever doctor takes
        props = torch.cuda.get_device_properties(device)
        out["gpu"] = {"name": props.name, "multiprocessors": props.multi_processor_count,
                      "memory_gib": props.total_memory / 2**30, "capability": f"{props.major}.{props.minor}",
                      "driver": _driver_version()}
    _save(out)
    try:  # well inside the phase's 90 s: a doctor that builds the CPU kernels on a fresh machine is cut, not fatal
        doctor = subprocess.run([sys.executable, "-m", "blink.services.cli", "doctor"], capture_output=True,
                                text=True, timeout=45)
        out["doctor"] = (doctor.stdout + doctor.stderr)[-4000:]
    except subprocess.TimeoutExpired:
        out["doctor"] = "cut after 45 s"
    modes, reasons = candidates("auto", device)
    out["modes"], out["modes_unavailable"] = modes, reasons
    if device.type != "cuda":
        return
    table = SlotTable.create(f"gpu-bench-{uuid.uuid4().hex[:8]}", Geometry(4, 64, 8))
    try:
        TableMemory(table, device).close()
        out["host_register"] = "ok"
    except Exception as e:  # what failed is the finding
        out["host_register"] = f"failed: {e}"
    finally:
        table.close()
        table.unlink()
    _save(out)
    out["copy_gb_s"] = copy_bandwidth(device) / 1e9
    out["read_gb_s"] = read_bandwidth(device) / 1e9
    out["bf16_matmul_tflops"] = matmul_rate(device) / 1e12


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes read plus bytes written per second by a large device-to-device copy (median of 20)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), 20)


def read_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Bytes read per second by a reduction over a large tensor (median of 20): a decode's reads write almost
    nothing, so its floor is this, not a copy's read-plus-write rate."""
    src = torch.ones(nbytes // 2, device=device, dtype=torch.bfloat16)
    return nbytes / _median_seconds(lambda: src.amax(), 20)


def matmul_rate(device: torch.device, n: int = 8192) -> float:
    """bf16 FLOP/s of an n×n×n product on random data (median of 10)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / _median_seconds(lambda: a @ b, 10)


def model(out: dict, dry_run: bool, shape: str) -> None:
    """One shape: an eager device step under sync-error mode, its profile by stage, step time per drive mode and
    batch (`--modes`, `--batches`), and batch-1 decode against the floor: the bytes it reads over the read
    bandwidth."""
    directory = model_dir(shape, dry_run)
    engine = engine_for(directory, dry_run)
    out["weight_bytes"] = weight_bytes(engine)
    out["decode_weight_bytes"] = weight_bytes(engine, tokens=1)
    out["kv_bytes_per_token"] = _kv_bytes_per_token(engine)
    if engine.device.type == "cuda":
        from blink.bench.gpu.profile import eager_step_checks

        try:  # a fault of the eager step's checks is a finding; the drive modes' timings still run
            out.update(eager_step_checks(engine))
        except Exception as e:
            out["eager_error"] = failure(e)
        _save(out)
    del engine
    free_memory()
    batches = _SELECTION["batches"] or ([1, 4] if dry_run else [1, 8, 64, 256])
    if dry_run:  # the tiny model's 8 slots
        batches = [b for b in batches if b <= 8] or [1]
    out["steps"] = {}
    modes = [m for m in drive_modes(dry_run) if _SELECTION["modes"] is None or m in _SELECTION["modes"]]
    out["modes_skipped"] = [m for m in drive_modes(dry_run) if m not in modes]
    if dry_run and not modes:  # the CPU runs the host mode alone: it stands in for the modes asked
        modes = ["host"]
    for mode in modes:
        try:
            out["steps"][mode] = step_times(directory, dry_run, mode, batches, sorted({batches[0], batches[-1]}))
        except Exception as e:  # the next mode still runs
            out["steps"][mode] = {"error": failure(e)}
        _save(out)
        free_memory()
    env_found = _env_result()
    probe = "read_gb_s" if env_found.get("read_gb_s") else "copy_gb_s"  # a run from before the read probe
    if bandwidth := env_found.get(probe):
        # Batch 1: the weights (the untied input embedding's one row), and a 64-token context's K/V.
        out["floor_bytes"] = out["decode_weight_bytes"] + 64 * out["kv_bytes_per_token"]
        out["floor_bandwidth"] = f"{probe} {bandwidth:.0f}"
        out["floor_ms"] = out["floor_bytes"] / (bandwidth * 1e9) * 1e3
        out["batch1_over_floor"] = {mode: r["1"]["ms_per_step"] / out["floor_ms"]
                                    for mode, r in out["steps"].items() if "1" in r}


def fp8_model(out: dict, dry_run: bool, shape: str) -> None:
    """`model` for a shape with `--quantization fp8` (issue 43: batch 1 within 1.3x of the FP8 floor, its
    projections a byte a weight; batch 256 against the bf16 phase's), in the graph mode alone where it is asked for:
    the question is the FP8 products, which every device mode runs alike. Only where FP8 products run (CUDA,
    compute capability 8.9+): elsewhere the weights would run dequantized, which measures nothing of FP8."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        out["skipped"] = "no GPU with FP8 products (CUDA, compute capability 8.9+)"
        return
    os.environ["BLINK_QUANTIZATION"] = "fp8"  # engine_options reads it, as `blink serve`'s settings would
    if _SELECTION["modes"] and "graph" in _SELECTION["modes"]:
        _SELECTION["modes"] = ["graph"]
    model(out, dry_run, shape)


def fp8_kv(out: dict, dry_run: bool, shape: str) -> None:
    """A shape's decode at the KV-heavy batch (the largest asked, 256 by default) with pages in the model's dtype,
    then in FP8 (`--kv-cache-dtype fp8`, issue 43), side by side in the graph mode: each one's step time and their
    ratio. Only where FP8 pages run (the Triton kernels on CUDA, compute capability 8.9+ for float8 conversions)."""
    if dry_run or not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        out["skipped"] = "no GPU with float8 conversions (CUDA, compute capability 8.9+): FP8 KV pages need one"
        return
    directory = model_dir(shape, dry_run)
    modes = drive_modes(dry_run)
    mode = "graph" if "graph" in modes else modes[0]
    batch = max(_SELECTION["batches"] or [256])
    out.update(mode=mode, batch=batch, steps={})
    for kv in ("auto", "fp8"):
        os.environ["BLINK_KV_CACHE_DTYPE"] = kv  # engine_options reads it, as `blink serve`'s settings would
        try:
            out["steps"][kv] = step_times(directory, dry_run, mode, [batch])
        except Exception as e:  # the other still runs
            out["steps"][kv] = {"error": failure(e)}
        _save(out)
        free_memory()
    os.environ.pop("BLINK_KV_CACHE_DTYPE", None)
    times = [out["steps"][kv].get(str(batch), {}).get("ms_per_step") for kv in ("auto", "fp8")]
    if all(times):
        out["fp8_over_auto_ms_per_step"] = times[1] / times[0]


def persistent(out: dict, dry_run: bool) -> None:
    """The loop's node kind, stop and restart with requests in flight, and whether a context-wide sync from
    another thread returns while the loop runs (the deadlock probe)."""
    if dry_run or "persistent" not in drive_modes(dry_run):
        out["skipped"] = "persistent does not run here"
        return
    from blink.engine.drive.modes import build
    from blink.shared.slot_table import Request, SlotTable

    engine = engine_for(model_dir(SHAPES[0], dry_run), dry_run)
    table = SlotTable.create(f"gpu-bench-{uuid.uuid4().hex[:8]}", engine.geometry(256, max_prompt_tokens=512))
    driver = build("persistent", engine, table)
    try:
        out["conditional"] = "switch" if driver.switch else "if-chain"
        requests = {slot: Request(list(range(50 + slot, 70 + slot)), 200, temperature=0.0, ignore_eos=True)
                    for slot in range(8)}
        got = drive_requests(driver, table, requests, restarts=3)
        out["restart"] = {"launches": driver.launches,
                          "all_finished_whole": all(len(t) == 200 for t in got.values())}
        _save(out)
        for slot, request in requests.items():  # in flight while the probe syncs
            table.publish(slot, Request(request.prompt, 2000, temperature=0.0, ignore_eos=True))
        driver.start()
        time.sleep(0.5)
        synced = threading.Event()
        threading.Thread(target=lambda: (torch.cuda.synchronize(), synced.set()), daemon=True).start()
        out["sync_while_running"] = "returned" if synced.wait(3.0) else "blocked (3 s)"
        _save(out)
        driver.stop()
        out["sync_after_stop"] = "returned" if synced.wait(10.0) else "still blocked (10 s)"
    finally:
        driver.close()
        table.close()
        table.unlink()


GPU_TESTS = ("tests/engine/test_kernels.py", "tests/engine/test_device_step.py", "tests/serving/test_drive_modes.py",
             "tests/engine/test_persistent_drive.py", "tests/engine/test_step.py", "tests/engine/test_loading.py",
             "tests/engine/test_window_rule.py", "tests/engine/test_sampler_kernel.py",
             "tests/engine/test_prefix_cache.py", "tests/engine/test_fp8.py",
             "tests/engine/test_grammar_device_gpu.py",  # the grammar kernels captured, in both device modes
             # speculation captured (looked up and a draft model's), in both device modes
             "tests/engine/test_speculation_device.py::test_the_device_modes_serve_plain_decoding_s_tokens_with_drafts"
             "_accepted")


def tests(out: dict, dry_run: bool) -> None:
    """The `gpu`-marked tests and the kernel and device-step tests, compiled on the GPU (from a checkout). pytest's
    report goes to tests.log line by line (verbose, unbuffered), so a phase cut by the budget still shows each test
    it reached and how it ended."""
    if dry_run or not Path(GPU_TESTS[0]).is_file():
        out["skipped"] = "the suite runs in CI" if dry_run else "no checkout here (tests/ is not installed)"
        return
    log = _PATH.with_name("tests.log")
    out["log"] = str(log)
    _save(out)
    with log.open("w") as f:
        subprocess.run([sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-o",
                        "faulthandler_timeout=120", *GPU_TESTS], stdout=f, stderr=subprocess.STDOUT, text=True,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out.update(tests_report(log.read_text(), whole=True))


def tests_report(log: str, whole: bool) -> dict:
    """The tests phase's findings from pytest's verbose log: its last line (or where a cut left it), the tests that
    failed or broke, and the log's tail."""
    lines = log.splitlines()
    if whole:  # -rfE's summary names each
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    else:  # only the progress lines so far: `path::test FAILED [ 20%]`
        failed = [line for line in lines if "::" in line and (" FAILED" in line or " ERROR" in line)]
    ran = sum("::" in line and " PASSED" in line for line in lines)
    summary = (lines[-1] if lines else "") if whole else f"cut by the budget: {ran} passed, {len(failed)} failed so far"
    return {"summary": summary, "failed": failed, "log_tail": "\n".join(lines)[-6000:]}


def compiled(out: dict, dry_run: bool, shape: str) -> None:
    """`model` for a shape with the step's admission, planning and commit traced by torch.compile
    (`--compile-bookkeeping`): beside the plain phase's figures, what compiling buys on this GPU. Not in a dry run:
    compiling takes minutes on two cores (the CPU's figure is `blink bench cpu --compile-bookkeeping`'s, and
    tests/engine/test_device_step.py checks the compiled step decides as the eager one)."""
    if dry_run:
        out["skipped"] = "compiling the bookkeeping takes minutes on the CPU"
        return
    os.environ["BLINK_COMPILE_BOOKKEEPING"] = "1"  # engine_options reads it, as `blink serve`'s settings would
    # The device modes: the host mode would compile inside its timed steps (and `blink serve` refuses it compiled).
    _SELECTION["modes"] = [m for m in _SELECTION["modes"] or drive_modes(dry_run) if m != "host"]
    model(out, dry_run, shape)


def _kv_bytes_per_token(engine) -> int:
    return engine.pool.page_bytes // engine.pool.page_size  # in the pages' dtype (FP8 with --kv-cache-dtype fp8)


def _median_seconds(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=30)
    return done.stdout.strip() or None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


_PATH: Path | None = None
_SELECTION: dict = {"modes": None, "batches": None}  # --modes, --batches: what the model phases time


def _save(out: dict) -> None:
    """What a phase has found so far: a phase killed at its timeout still leaves it, whole (written aside, then
    renamed: a kill mid-write leaves the last save)."""
    partial = _PATH.with_suffix(".partial")
    partial.write_text(json.dumps(out, indent=1, default=str))
    os.replace(partial, _PATH)


def _env_result() -> dict:
    path = _PATH.parent / "env.json"
    return json.loads(path.read_text()) if path.is_file() else {}


PHASES = {"env": env, "model-llama3-1b": lambda o, d: model(o, d, SHAPES[0]),
          "model-llama3-8b": lambda o, d: model(o, d, SHAPES[1]),
          "model-llama3-8b-fp8": lambda o, d: fp8_model(o, d, SHAPES[1]), "parity": lambda o, d: parity(o, d, _save),
          "persistent": persistent,
          "model-llama3-8b-kv-fp8": lambda o, d: fp8_kv(o, d, SHAPES[1]),
          "model-llama3-1b-compiled": lambda o, d: compiled(o, d, SHAPES[0]),
          "model-qwen3-30b-a3b-24l": lambda o, d: model(o, d, SHAPES[2]),
          "interference": lambda o, d: interference(o, d, _save), "kv-pressure": lambda o, d: kv_pressure(o, d, _save),
          "tests": tests}


def main(argv: list[str]) -> int:
    global _PATH
    p = argparse.ArgumentParser(prog="python -m blink.bench.gpu.phases")
    p.add_argument("phase", choices=PHASES)
    p.add_argument("out", type=Path)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--modes", nargs="+")
    p.add_argument("--batches", nargs="+", type=int)
    args = p.parse_args(argv)
    _PATH = args.out / f"{args.phase}.json"
    _SELECTION.update(modes=args.modes, batches=args.batches)
    out: dict = {"phase": args.phase, "dry_run": args.dry_run}
    started = time.monotonic()
    try:
        PHASES[args.phase](out, args.dry_run)
    except Exception as e:
        out["error"] = failure(e)
        raise
    finally:
        out["seconds"] = time.monotonic() - started
        _save(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
