"""The one admission: a record with every field of the request schema set to something other than its default,
admitted by the host path, the device path (its kernels in Triton's interpreter) and the offline path, lands
the same in the engine's state, field by field, and as the record says."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from blink.engine.core.admission import admit_records
from blink.engine.core.state import SlotStatus
from blink.engine.drive.device_step import DeviceStep
from blink.engine.drive.offline import OfflineDriver
from blink.engine.sampling_params import SamplingParams
from blink.shared.request_schema import FIELDS, MAX_STOP_IDS, Request
from blink.shared.service_class import ServiceClass

EVERY_FIELD = Request(
    prompt=[5, 6, 7, 8, 9], max_tokens=7, priority=-3, ignore_eos=True, temperature=0.7, top_p=0.9, top_k=12,
    min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=-0.4, logprobs=3, seed=2**62 + 5,
    service_class=int(ServiceClass.BEST_EFFORT), ttft_slo_ms=250.0, tpot_slo_ms=40.0, stop_token_ids=(3, 4),
    min_tokens=2, prompt_logprobs=4, logit_bias=((2, -1.5), (11, 3.0)), grammar_kind=2, grammar="[a-z]+",
    reasoning_end_id=9,
)
DERIVED = {"prompt_len", "num_stop_ids", "num_logit_bias", "grammar_len"}  # from the prompt and the arrays
# Every state tensor admission writes: the schema's, and what it derives or resets.
LANDED = [f.name for f in FIELDS if f.state is not None] + [
    "seq_len", "stop_ids", "logit_bias_ids", "logit_bias", "tpot_slo", "status", "num_computed", "finish_reason",
    "cancel", "paused", "rotated", "scored", "preemptions", "pages_out", "pages_in", "wait_s", "prompt_mask",
    "output_counts"]


def test_the_request_sets_every_field_of_the_schema():
    """Else a new field could be mis-wired and this file would not notice."""
    for f in FIELDS:
        if f.name not in DERIVED:
            assert getattr(EVERY_FIELD, f.name) != f.default, f.name


def _used(engine):
    """Slot 0 as an earlier request left it: admission must clear what the penalties count."""
    engine.state.prompt_mask[0] = True
    engine.state.output_counts[0] = 7


def _host(engine, table, now):
    _used(engine)
    table.publish(0, EVERY_FIELD)
    assert admit_records(engine.state, table.slots, [0], now, 0, engine.model_config.vocab_size,
                         engine.max_model_len).invalid == []
    return engine.state


def _device(engine, table, now):
    _used(engine)
    # The device admits a record with a grammar once the host put its table on the device (tests/engine/
    # test_grammar_device_step.py), which this model, with no end-of-sequence token, cannot have: the published
    # record without its grammar, which admission does not land in the state.
    table.slots[0]["grammar_kind"], table.slots[0]["grammar_len"] = 0, 0
    device = DeviceStep(engine, table)
    try:
        device.clock[0] = now
        device.take()
    finally:
        device.close()
    return engine.state


def _offline(engine, table, now):
    r = EVERY_FIELD
    params = SamplingParams(max_tokens=r.max_tokens, logprobs=r.logprobs, prompt_logprobs=r.prompt_logprobs,
                            logit_bias=dict(r.logit_bias),
                            seed=r.seed, stop_token_ids=[3, 4],
                            service_class=ServiceClass(r.service_class), ttft_slo_ms=r.ttft_slo_ms,
                            tpot_slo_ms=r.tpot_slo_ms, **{f.name: getattr(r, f.name) for f in FIELDS if f.knob})
    _used(engine)
    driver = OfflineDriver(engine)
    driver.add_request("every-field", r.prompt, params, r.max_tokens)
    driver._fill_slots()
    assert list(driver._resident) == [0]
    return engine.state


@pytest.mark.parametrize("path", [_device, _offline], ids=["device", "offline"])
def test_every_path_lands_a_record_as_the_host_path_does(tiny_engine, small_table, path):
    now = time.monotonic()
    host = _host(tiny_engine(), small_table, now)
    other = path(tiny_engine(), small_table, now)
    for name in LANDED:
        assert torch.equal(getattr(other, name)[0], getattr(host, name)[0]), name
    assert torch.equal(other.tokens[0, :5], host.tokens[0, :5])
    # The TTFT deadline is the clock at admission plus the SLO; the offline path counts from when its request was
    # added, on its own clock: after `now`, by no more than the time since (building its engine, on a slow runner).
    late = other.ttft_deadline[0].item() - host.ttft_deadline[0].item()
    assert 0 <= late <= time.monotonic() - now


def test_the_host_path_lands_what_the_record_says(tiny_engine, small_table):
    engine = tiny_engine()
    now = time.monotonic()
    state = _host(engine, small_table, now)
    r = dataclasses.asdict(EVERY_FIELD)
    for f in FIELDS:
        if f.state is not None and f.name not in DERIVED | {"seed"}:
            assert state.__dict__[f.name][0].item() == pytest.approx(r[f.name], rel=1e-6), f.name
    assert state.prompt_len[0] == state.seq_len[0] == 5
    assert state.seed[0] == EVERY_FIELD.seed
    assert state.stop_ids[0].tolist() == [3, 4] + [-1] * (MAX_STOP_IDS - 2)
    assert state.tpot_slo[0].item() == pytest.approx(0.040)
    assert state.ttft_deadline[0].item() == pytest.approx(now + 0.250)
    assert state.status[0] == SlotStatus.ADMITTED and state.tokens[0, :5].tolist() == EVERY_FIELD.prompt
    assert state.prompt_mask[0].nonzero()[:, 0].tolist() == sorted(EVERY_FIELD.prompt)  # for the penalties
    assert not state.output_counts[0].any()


def test_no_slo_lands_as_none(tiny_engine, small_table):
    engine = tiny_engine()
    small_table.publish(1, Request([1, 2, 3], 4))
    admit_records(engine.state, small_table.slots, [1], time.monotonic(), 0, engine.model_config.vocab_size,
                  engine.max_model_len)
    assert math.isinf(engine.state.ttft_deadline[1].item()) and math.isinf(engine.state.tpot_slo[1].item())
    assert engine.state.logprobs[1] == -1 and not engine.state.ignore_eos[1]


def test_every_knob_reaches_both_apis_with_the_schemas_limits():
    from pydantic import ValidationError

    from blink.ingress.protocol import ChatRequest, CompletionRequest
    from blink.shared.request_schema import KNOBS

    bodies = {CompletionRequest: {"model": "m", "prompt": "x"},
              ChatRequest: {"model": "m", "messages": [{"role": "user"}]}, SamplingParams: {}}
    for model, body in bodies.items():
        model.model_validate(body)  # valid as it is: any error below is the knob's
        for f in KNOBS:
            assert model.model_fields[f.name].default == f.default, (model.__name__, f.name)
            if f.python_type is bool:
                continue
            step = 1e-3 if f.python_type is float else 1
            for bound, outside in (("ge", -step), ("gt", 0), ("le", step), ("lt", 0)):
                if (limit := getattr(f, bound)) is not None:
                    with pytest.raises(ValidationError, match=f.name):
                        model.model_validate({**body, f.name: f.python_type(limit + outside)})


def test_request_declares_the_attributes_the_schema_makes():
    """`Request` is written out for an editor to see; FIELDS stays the one source: a field added there and not here
    fails, with the lines to write."""
    from typing import get_type_hints

    from blink.shared.request_schema import request_fields

    hints = get_type_hints(Request)
    declared = [(f.name, hints[f.name], f.default) for f in dataclasses.fields(Request)]
    expected = request_fields()

    def line(name, kind, default):
        shown = kind.__name__ if isinstance(kind, type) else str(kind)
        return f"    {name}: {shown}" + ("" if default is dataclasses.MISSING else f" = {default!r}")

    assert declared == expected, "Request must declare, in this order:\n" + "\n".join(line(*f) for f in expected)
    assert all(type(d) is type(e) for (*_, d), (*_, e) in zip(declared, expected, strict=True))  # False is not 0


def test_slots_declare_the_tensors_the_schema_makes():
    """Slots makes a tensor per schema field with a state dtype from FIELDS, and declares them (with their dtypes)
    for an editor to see: the two must agree."""
    import inspect
    import re

    from blink.engine.core.state import Slots

    source = inspect.getsource(Slots)
    declared = re.findall(r"^    (\w+): torch\.Tensor  # (\w+)$", source, re.MULTILINE)
    expected = [(f.name, f.state) for f in FIELDS if f.state is not None]
    assert declared == expected, "Slots must declare, in this order:\n" + "\n".join(
        f"    {name}: torch.Tensor  # {dtype}" for name, dtype in expected)
    state = Slots(2, 8, 2, 16, torch.device("cpu"))
    assert all(getattr(state, name).dtype == getattr(torch, dtype) for name, dtype in expected)


def test_the_host_takes_what_each_request_asked_from_the_fields_admission_copied(tiny_engine, small_table):
    from blink.engine.core.sampler import SamplerFeatures
    from blink.engine.drive.host import HostRank

    rank = HostRank(tiny_engine())
    small_table.publish(0, EVERY_FIELD)
    small_table.publish(2, Request([1, 2, 3], 4, temperature=0.0))
    assert rank.admit(small_table.slots, [2, 0], time.monotonic()) == []
    every, plain = rank.asked[0], rank.asked[2]
    assert every.features == SamplerFeatures(**dict.fromkeys(SamplerFeatures.__dataclass_fields__, True))
    assert (every.logprobs, every.prompt_logprobs) == (3, 4)
    assert plain.features == SamplerFeatures() and (plain.logprobs, plain.prompt_logprobs) == (-1, -1)
