"""The device step (admission from the slot table, the step, publication into it: the `graph` and `persistent` modes'
work) run eagerly on the CPU, its kernels in Triton's interpreter, against the `host` mode's table driver; and with
its admission, plan and commit traced whole by torch.compile (`Step.compile_bookkeeping`, through the aot_eager
backend: the traced graphs, run by torch's own ops), which must decide the same."""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest

from blink.engine.drive.device_step import DeviceStep
from blink.engine.drive.host import HostDriver
from blink.engine.engine import Engine, EngineConfig
from blink.shared.slot_table import Finish, Request, SlotState, SlotTable

REQUESTS = {
    0: Request([5, 6, 7, 8], 6, temperature=0.0, ignore_eos=True, logprobs=2),
    # Prefilled over several steps, scoring its prompt (34 entries through a window of 3) before generating.
    1: Request(list(range(10, 45)), 5, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
    2: Request([99] * 7, 7, temperature=0.8, top_k=20, seed=1234, ignore_eos=True),
    3: Request([42, 43], 9, temperature=0.0, stop_token_ids=(7,), repetition_penalty=1.3, logit_bias=((9, 4.0),)),
}


@pytest.fixture
def table(small_table):
    return small_table


def _serve(table: SlotTable, step, requests: dict[int, Request], steps: int = 120) -> dict[int, tuple]:
    """Publishes `requests`, steps until every one finished and was read; returns each slot's tokens, top
    logprob ids and finish."""
    for slot, request in requests.items():
        table.publish(slot, request)
    got = {slot: ([], [], None) for slot in requests}
    for i in range(steps):
        step()
        if i % 4 != 3:
            continue  # a slow reader: the window holds 3 tokens, so the engine pauses slots until it reads
        for slot in requests:
            out = table.read(slot)
            tokens, tops, _ = got[slot]
            got[slot] = (tokens + out.tokens, tops + [ids[:2] for ids in out.top_ids], out.finish or got[slot][2])
        if all(finish for *_, finish in got.values()):
            return got
    raise AssertionError(f"not finished after {steps} steps: {got}")


@pytest.fixture
def devices():
    """Closes the device steps a test opened: on CUDA each one registers the table's mapping, which must be
    unregistered before the table is unmapped."""
    opened: list[DeviceStep] = []
    yield opened
    for device in opened:
        device.close()


def _device(engine: Engine, table: SlotTable, opened: list, compiled: bool = False) -> tuple[DeviceStep, callable]:
    device = DeviceStep(engine, table)
    opened.append(device)
    if compiled:  # traced with fullgraph: a graph break fails the test
        device.step.compile_bookkeeping(backend="aot_eager")

    def step():
        device.clock[0] = time.monotonic()
        device.run(device.bucket_for(int(device.demand[0])))

    return device, step


def test_device_step_serves_the_table_as_the_host_driver_does(tiny_engine, table, devices):
    """Greedy, seeded, stop-id, penalised and logprob requests: identical tokens, top ids and finishes; the window
    (3 tokens) pauses the engine without losing a token; buckets smaller than a prompt chunk its prefill."""
    host = HostDriver(tiny_engine(), table)
    expected = _serve(table, host.step, REQUESTS)
    for slot in REQUESTS:
        table.free(slot)
    for compiled in (False, True):
        device, step = _device(tiny_engine(), table, devices, compiled)
        assert _serve(table, step, REQUESTS) == expected, f"compiled: {compiled}"
        for slot in REQUESTS:
            table.free(slot)
    assert [len(expected[s][0]) for s in (0, 1, 2)] == [6, 34 + 5, 7]
    assert expected[1][0][:34] == list(range(11, 45))  # the prompt's tokens after the first, scored
    # Top logprobs only where asked (slot 1 asked for its prompt's).
    assert expected[0][1][0] != [0, 0] and expected[1][1][0] != [0, 0] and all(ids == [0, 0] for ids in expected[2][1])
    assert int(device.demand[1]) == 0  # nothing resident: every slot was handed back


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen2-moe"])
def test_a_mixture_of_experts_runs_in_the_device_step(kind, tiny_engine, table, devices, monkeypatch):
    """The experts through the grouped kernel (fixed shapes, no host read): the device step serves what the host
    driver serves with the same kernels; with the torch kernels the device step refuses, saying why."""
    monkeypatch.setenv("BLINK_KERNELS", "triton")
    requests = {slot: REQUESTS[slot] for slot in (0, 2, 3)}
    expected = _serve(table, HostDriver(tiny_engine(kind), table).step, requests)
    for slot in requests:
        table.free(slot)
    _, step = _device(tiny_engine(kind), table, devices)
    assert _serve(table, step, requests) == expected
    monkeypatch.setenv("BLINK_KERNELS", "torch")
    with pytest.raises(RuntimeError, match="Triton kernels only"):
        DeviceStep(tiny_engine(kind), table)


def test_the_device_step_makes_the_host_modes_policy_decisions(checkpoint, table, devices):
    """One scripted workload through the host driver and through the device step: both classes, a TTFT deadline, a
    pool too small for the requests (rotation out and back), a request cancelled mid-run and a slow reader (the
    3-token window pauses slots), on one scripted clock. Per request: the same tokens, the same finish, the same
    preemptions and pages rotated each way; no page leaks on either side. (No TPOT SLO here: the host driver fits
    its step cost on the host's clock, the device step on the clock it reads.)"""
    from blink.shared.service_class import ServiceClass

    be, ls = int(ServiceClass.BEST_EFFORT), int(ServiceClass.LATENCY_SENSITIVE)
    requests = {0: Request(list(range(5, 35)), 30, temperature=0.0, ignore_eos=True, service_class=be),
                1: Request(list(range(40, 70)), 30, temperature=0.0, ignore_eos=True, service_class=be),
                2: Request(list(range(70, 90)), 25, temperature=0.7, seed=3, ignore_eos=True, service_class=ls,
                           ttft_slo_ms=50.0),
                3: Request(list(range(90, 100)), 30, temperature=0.0, ignore_eos=True, service_class=ls)}
    late = {3: 6}  # slot 3 arrives at step 6
    cancel_at = {0: 40}  # slot 0 is cancelled at step 40 (rotated out by then)

    def serve(step) -> tuple[dict, object]:
        got = {slot: ([], None, None) for slot in requests}
        for slot, request in requests.items():
            if slot not in late:
                table.publish(slot, request)
        for i in range(600):
            for slot, at in late.items():
                if i == at:
                    table.publish(slot, requests[slot])
            for slot, at in cancel_at.items():
                if i == at:
                    table.cancel(slot)
            step(1000.0 + 0.02 * i)
            if i % 4 == 3:  # a slow reader
                for slot in requests:
                    out = table.read(slot)
                    tokens, finish, stats = got[slot]
                    got[slot] = (tokens + out.tokens, out.finish or finish, out.stats or stats)
            if all(finish for _, finish, _ in got.values()):
                return got
        raise AssertionError(f"not finished: {got}")

    served, moved = {}, {}
    for mode in ("host", "device", "compiled"):
        engine = Engine(EngineConfig(model=str(checkpoint("qwen3")), max_num_seqs=4, max_num_batched_tokens=32,
                                     num_pages=15, page_size=8, max_model_len=96))
        if mode == "host":
            driver = HostDriver(engine, table)

            def step(now, driver=driver):
                driver.step()
        else:
            device, _ = _device(engine, table, devices, compiled=mode == "compiled")

            def step(now, device=device):  # on the whole budget, as the host plans (a smaller bucket computes
                device.clock[0] = now  # fewer tokens in that step, and the cancel would find another count)
                device.run(device.buckets[-1])
        served[mode] = serve(step)
        moved[mode] = engine.mirror.pages_moved.tolist()
        assert int(engine.pool.num_free) == engine.pool.usable_pages
        assert int(engine.mirror.free.num_free) == engine.mirror.num_pages - 1
        for slot in requests:
            table.free(slot)
    def decisions(got: dict) -> dict:  # wait_ms aside: the host driver times waits on the host's clock
        return {slot: (tokens, finish, dataclasses.replace(stats, wait_ms=0)) for slot, (tokens, finish, stats)
                in got.items()}

    host = served["host"]
    assert decisions(served["device"]) == decisions(host) == decisions(served["compiled"])
    assert host[0][1] == Finish.ABORT and host[0][2].pages_out > 0  # cancelled after it was rotated out
    assert sum(stats.pages_out for _, _, stats in host.values()) > 0
    assert moved["device"] == moved["host"] == moved["compiled"]


def test_the_device_step_reuses_cached_prefixes_as_the_host_driver_does(checkpoint, table, devices):
    """Prefix caching inside the device step: a prompt, then (once it finished) the same prompt, one sharing its
    first five pages, one ending mid-page and a seeded one. The device step gives the host driver's tokens and
    cached tokens, and the tokens of a host driver without the cache."""
    prompt = list(range(10, 60))  # six full pages of 8
    waves = [{0: Request(prompt, 5, temperature=0.0, ignore_eos=True)},
             {0: Request(prompt, 5, temperature=0.0, ignore_eos=True),
              1: Request([*prompt[:40], 7, 7, 7], 5, temperature=0.0, ignore_eos=True),
              2: Request(prompt[:21], 5, temperature=0.0, ignore_eos=True),
              3: Request([*prompt, 3], 5, temperature=0.8, seed=9, ignore_eos=True)}]

    def serve(caching: bool, device: bool) -> list[dict]:
        engine = Engine(EngineConfig(model=str(checkpoint("qwen3")), max_num_seqs=4, max_num_batched_tokens=32,
                                     num_pages=64, page_size=8, max_model_len=96, enable_prefix_caching=caching))
        step = _device(engine, table, devices)[1] if device else HostDriver(engine, table).step
        served = []
        for wave in waves:
            got = _serve(table, step, wave)
            cached = {slot: int(table.slots[slot]["cached_tokens"]) for slot in wave}  # the finished record's
            served.append({slot: (got[slot][0], got[slot][2], cached[slot]) for slot in wave})
            for slot in wave:
                table.free(slot)
        return served

    host = serve(caching=True, device=False)
    assert [cached for *_, cached in host[1].values()] == [48, 40, 16, 48]
    assert serve(caching=True, device=True) == host
    plain = serve(caching=False, device=False)
    assert [{s: got[:2] for s, got in wave.items()} for wave in plain] == [
        {s: got[:2] for s, got in wave.items()} for wave in host]


def test_invalid_records_end_and_a_newer_epoch_fences_the_device(tiny_engine, table, devices):
    engine = tiny_engine()
    device, step = _device(engine, table, devices)
    vocab = engine.model_config.vocab_size
    table.publish(0, Request([1, vocab], 4))  # a token the model does not have: the ingress should have said so
    table.publish(1, Request([1, 2, 3], 4, temperature=0.0, ignore_eos=True))
    step()
    assert int(table.slots[0]["state"]) == SlotState.FINISHED
    assert table.read(0).finish == Finish.ABORT
    assert int(table.slots[1]["state"]) == SlotState.ADMITTED and int(table.slots[1]["produced"]) == 1
    steps = int(table.header["steps"])
    table.fail_over()  # a watchdog declared this engine dead
    table.reclaim(1)  # the ingress takes the slot back and publishes into it for the next engine
    table.publish(1, Request([4, 5], 4))
    for _ in range(3):
        step()
    assert device.fenced
    assert int(table.header["steps"]) == steps
    assert int(table.slots[1]["state"]) == SlotState.SUBMITTED  # the fenced steps admitted nothing, not last step's


def test_cancel_and_the_admission_limit(tiny_engine, table, devices):
    engine = tiny_engine()
    device, step = _device(engine, table, devices)
    device.limit[0] = 2  # the control plane's admission limit, written where the device reads it
    for slot in range(4):
        table.publish(slot, Request([3 + slot, 4, 5], 40, temperature=0.0, ignore_eos=True))
    step()
    states = [int(s) for s in table.slots["state"]]
    assert states == [SlotState.ADMITTED, SlotState.ADMITTED, SlotState.SUBMITTED, SlotState.SUBMITTED]
    table.cancel(0)
    step()
    assert table.read(0).finish == Finish.ABORT
    table.free(0)
    step()  # slot 0's place goes to the first request still waiting
    assert int(table.slots[2]["state"]) == SlotState.ADMITTED and int(table.slots[3]["state"]) == SlotState.SUBMITTED


def test_the_device_step_fits_its_step_cost_and_caps_tokens_for_a_tight_tpot(checkpoint):
    """The step times itself from the clock it reads (here a clock that says each step took 10 ms + 0.5 ms per
    token, and once a long nap), fits a + b·tokens in device memory, and the TPOT cap uses the fit: a long prompt
    beside a decode with a tight TPOT SLO is cut to the cap's floor, as the host mode cuts it."""
    engine = Engine(EngineConfig(model=str(checkpoint("qwen3")), max_num_seqs=4, max_num_batched_tokens=256,
                                 num_pages=80, page_size=8, max_model_len=256,
                                 enable_prefix_caching=False))  # each round computes the same prompt whole
    table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", engine.geometry(8, 256))
    device = DeviceStep(engine, table)
    now = 1000.0

    def step():
        nonlocal now
        device.clock[0] = now
        device.run(device.bucket_for(int(device.demand[0])))
        now += 0.010 + 0.0005 * int(device._last_tokens) + (5.0 if step.nap else 0.0)

    try:
        table.publish(0, Request(list(range(5, 205)), 40, temperature=0.0, ignore_eos=True))  # chunks, then decodes
        table.publish(1, Request([7, 8, 9], 40, temperature=0.0, ignore_eos=True))
        for i in range(30):
            step.nap = i == 20
            step()
            table.read(0), table.read(1)
        a, b = device.step.cost.fit.tolist()
        assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(0.0005, rel=1e-6)  # the nap left out
        step.nap = False

        def end_both() -> None:
            for slot in (0, 1):
                table.cancel(slot)
            for _ in range(3):
                step()
            for slot in (0, 1):
                table.read(slot), table.free(slot)

        end_both()

        def tokens_beside_a_decode(tpot_slo_ms: float) -> int:
            table.publish(0, Request([3, 4, 5], 30, temperature=0.0, ignore_eos=True, tpot_slo_ms=tpot_slo_ms))
            step()  # its prefill: it decodes from now on
            table.publish(1, Request(list(range(10, 210)), 1, temperature=0.0))
            step()  # admits it, on the bucket the demand before it asked for (16 tokens: the decode and 15)
            step()
            tokens = int(device._last_tokens)
            end_both()
            return tokens

        assert tokens_beside_a_decode(1000.0) == 186  # the decode and the rest of the prompt
        # 30 ms leaves (30 - 10) / 0.5 = 40 tokens a step by the fit; the cap never goes below 64.
        assert tokens_beside_a_decode(30.0) == 64
        assert tokens_beside_a_decode(100.2) == 180  # (100.2 - 10) / 0.5 = 180.4
    finally:
        device.close()
        table.close()
        table.unlink()
