"""`blink bench gpu`'s stage profile wraps functions by name on a GPU only: here, on the CPU, a device step runs under
it, so a renamed function, or a wrapper the step no longer calls, fails a test rather than a lent GPU's run; and the
step runs as it does unprofiled (the device step tells the references' admission and plan by identity)."""

import functools
from collections import Counter

from blink.bench.gpu import profile
from blink.engine.core import step as step_module
from blink.engine.drive import device_step
from blink.engine.drive.device_step import DeviceStep
from blink.engine.kernels import admission, page_release
from blink.shared.slot_table import Request


def test_the_stage_profile_wraps_what_the_device_step_calls_and_restores_it(tiny_engine, small_table, monkeypatch):
    called = Counter()

    def counted(fn, label):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            called[label] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(profile, "_ranged", counted)
    engine = tiny_engine()
    step = DeviceStep(engine, small_table)
    core = engine.step
    before = (core.admitter, core.planner, core.committer, core.sampler, device_step.admit, device_step.plan,
              admission.admit, step_module.score_prompt)
    try:
        small_table.publish(0, Request(list(range(5, 20)), 4, temperature=0.0, prompt_logprobs=1))
        with profile._stages(core):
            for _ in range(3):
                step.run(step.bucket_for(max(int(step.demand[0]), 1)))
            assert engine.pool.prefix_cache.kernels is page_release.KERNELS  # the plan known as the reference's
        assert set(called) == {f"blink.{stage}" for stage in ("exchange", "admit", "plan", "forward", "logits",
                                                              "sample", "commit")}, called
        assert (core.admitter, core.planner, core.committer, core.sampler, device_step.admit, device_step.plan,
                admission.admit, step_module.score_prompt) == before
    finally:
        step.close()
