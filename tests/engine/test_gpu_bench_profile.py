"""`blink bench gpu`'s stage profile wraps functions by name on a GPU only: their names are checked here, on the CPU,
so a renamed function fails a test rather than a lent GPU's run."""

from blink.bench.gpu.profile import _stages
from blink.engine.core import step as step_module
from blink.engine.drive import device_step


def test_the_stage_profile_wraps_what_the_step_calls_and_restores_it(tiny_engine):
    engine = tiny_engine()
    step, sampler, commit, plan = engine.step, engine.step.sampler, step_module.commit, device_step.plan
    with _stages(step):
        assert step.sampler.sample is not sampler.sample and step.sampler.sample.__wrapped__ is sampler.sample
        assert step_module.commit.__wrapped__ is commit and device_step.plan.__wrapped__ is plan
    assert step.sampler is sampler and step_module.commit is commit and device_step.plan is plan
