"""One shape's eager device step, for `blink bench gpu`: whether it runs without a host sync (torch's sync debug
mode set to error), its wall time, and the GPU time of each stage (exchange, admit, plan, forward, logits,
sample, commit) from torch's profiler, each stage's functions wrapped in a named range for the run."""

from __future__ import annotations

import functools
import time
import types
import uuid
from contextlib import contextmanager

import torch

from blink.engine.core.sampler import Sampler
from blink.engine.core.step import Step
from blink.engine.drive.device_step import DeviceStep
from blink.engine.engine import Engine
from blink.shared.slot_table import Request, SlotTable

STEPS = 10


def eager_step_checks(engine: Engine) -> dict:
    table = SlotTable.create(f"gpu-bench-{uuid.uuid4().hex[:8]}", engine.geometry(1024, max_prompt_tokens=512))
    step = DeviceStep(engine, table)
    out: dict = {}
    try:
        for slot in range(8):  # sampled with every filter on, one scoring its prompt
            table.publish(slot, Request(list(range(10 + slot, 40 + slot)), 900, temperature=0.8, top_p=0.9,
                                        top_k=50, seed=slot, ignore_eos=True, prompt_logprobs=1 if slot == 0 else -1))

        def run() -> None:
            step.clock[0] = time.monotonic()
            step.run(step.bucket_for(int(step.demand[0])))

        for _ in range(4):  # compiles the kernels; admits and prefills
            run()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                run()
            out["eager_step_syncs"] = "none"
        except RuntimeError as e:
            out["eager_step_syncs"] = f"{e}"[:1500]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(STEPS):
            run()
        torch.cuda.synchronize()
        out["eager_step_ms"] = 1e3 * (time.perf_counter() - started) / STEPS
        out["profile_ms"] = _profile(run, engine.step)
        for slot in range(8):
            table.cancel(slot)
        run()
        torch.cuda.synchronize()
    finally:
        step.close()
        table.close()
        table.unlink()
    return out


def _profile(run, core_step: Step) -> dict[str, float]:
    """GPU milliseconds per eager step in each stage (the kernels its functions launched)."""
    from torch.profiler import ProfilerActivity, profile

    with _stages(core_step), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            run()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    stages = {e.key.removeprefix("blink."): _device_us(e, "device_time_total") / STEPS / 1e3
              for e in averages if e.key.startswith("blink.")}
    return stages


def _device_us(event, name: str) -> float:
    return float(getattr(event, name, None) or getattr(event, name.replace("device", "cuda"), 0) or 0)


@contextmanager
def _stages(core_step: Step):
    """Each stage's functions wrapped in a named range while the block runs, where the device step finds them: the
    module functions it looks up at each call, and the step's own (its admitter, planner, committer and sampler).
    The device step tells the references' admission and plan by identity (to take their kernels), so a wrapped
    reference is wrapped under both names and the step runs as it does unprofiled."""
    from blink.engine.core import step as step_module
    from blink.engine.drive import device_step
    from blink.engine.kernels import admission
    from blink.engine.model.model import Transformer

    stages = [(device_step, "take_requests", "exchange"), (device_step, "emit", "exchange"),
              (device_step, "report_demand", "exchange"), (admission, "admit", "admit"),
              (core_step, "admitter", "admit"), (core_step, "planner", "plan"), (Transformer, "forward", "forward"),
              (Transformer, "logits", "logits"), (step_module, "score_prompt", "sample"),
              (core_step, "committer", "commit")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in stages]
    saved += [(device_step, name, getattr(device_step, name)) for name in ("admit", "plan")]
    references = {"admitter": core_step.admitter is device_step.admit, "planner": core_step.planner is device_step.plan}
    for owner, name, stage in stages:
        setattr(owner, name, _ranged(getattr(owner, name), f"blink.{stage}"))
    if references["admitter"]:
        device_step.admit = core_step.admitter
    if references["planner"]:
        device_step.plan = core_step.planner
    sampler = core_step.sampler
    kernels = sampler.step and types.SimpleNamespace(rows_read=sampler.step.rows_read,  # the step's own, if any
                                                     sample=_ranged(sampler.step.sample, "blink.sample"))
    core_step.sampler = Sampler(_ranged(sampler.sample, "blink.sample"), _ranged(sampler.logprobs, "blink.sample"),
                                kernels)
    try:
        yield
    finally:
        core_step.sampler = sampler
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _ranged(fn, label: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return wrapper
