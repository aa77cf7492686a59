"""Choosing the drive mode, the fallback when a mode cannot run, and (on a GPU) the `graph` mode's tokens."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch

from blink.bench.lib.server import free_port, running_server
from blink.engine.drive.modes import candidates
from blink.shared.slot_table import Geometry, Request, SlotTable


def test_the_cpu_runs_the_host_mode_and_says_why_not_the_others():
    modes, reasons = candidates("auto", torch.device("cpu"))
    assert modes == ["host"]
    assert [r.split(":")[0] for r in reasons] == ["persistent", "graph"]
    assert all("CUDA" in r for r in reasons)
    modes, reasons = candidates("graph", torch.device("cpu"))  # asked for by name: that mode or nothing
    assert modes == [] and reasons[0].startswith("graph: needs a CUDA device")
    assert candidates("host", torch.device("cpu")) == (["host"], [])


def test_compiled_bookkeeping_is_served_by_the_device_modes_only():
    """The host mode would compile inside a served step (half a minute without a heartbeat): it is passed over,
    saying why, and a CPU has no mode left for it."""
    modes, reasons = candidates("auto", torch.device("cpu"), compile_bookkeeping=True)
    assert modes == [] and [r.split(":")[0] for r in reasons] == ["persistent", "graph", "host"]
    assert "watchdog takes for a stall" in reasons[-1]
    modes, reasons = candidates("auto", torch.device("cuda"), compile_bookkeeping=True)
    assert "host" not in modes and reasons[-1].startswith("host: --compile-bookkeeping")


def test_tensor_parallelism_runs_the_host_mode_and_says_why_not_the_device_modes():
    modes, reasons = candidates("auto", torch.device("cuda"), tensor_parallel_size=2)
    assert modes == ["host"]
    assert [r.split(":")[0] for r in reasons] == ["persistent", "graph"]
    assert all("tensor parallelism runs in the host mode" in r for r in reasons)


def test_serve_asked_for_persistent_on_the_cpu_refuses_to_start_and_says_why(tmp_path):
    """A result or a deployment labelled persistent must have run persistent: no silent fallback."""
    cmd = [sys.executable, "-m", "blink.services.cli", "serve", "--port", str(free_port()), "--deployment",
           f"test-{uuid.uuid4().hex[:10]}", "--runtime-dir", str(tmp_path), "--drive", "persistent", "--device", "cpu"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--drive persistent cannot run here" in out.stdout + out.stderr
    assert "needs a CUDA device" in out.stdout + out.stderr
    assert "engine ready" not in out.stdout + out.stderr  # refused before the model loaded


def test_serve_on_auto_falls_back_to_the_host_mode_and_reports_it(tmp_path):
    with running_server(tmp_path, "--device", "cpu") as server:
        assert httpx.get(f"{server.url}/ready").json()["drive"] == "host"
        metrics = httpx.get(f"{server.url}/metrics").text
        (info,) = [line for line in metrics.splitlines() if line.startswith("blink:engine_info{")]
        for label in ('drive="host"', 'transport="shm"', 'scheduling_policy="slo"', 'kv_rotation="on"'):
            assert label in info
        ready = httpx.get(f"{server.url}/ready").json()
        assert ready["kv_host_pages"] > 0 and ready["limitations"] == []
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "blink-tiny-llama-v1", "prompt": "Hi",
                                                              "max_tokens": 2, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200
    log = "".join(p.read_text() for p in tmp_path.glob("serve-*.log"))
    assert "drive mode unavailable" in log and "needs a CUDA device" in log
    assert '"scheduling_policy": "slo"' in log and '"kv_rotation": "on"' in log  # how it schedules, at start-up


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe"])
def test_graph_mode_gives_the_host_modes_greedy_tokens(kind, checkpoint):
    from blink.engine.drive.modes import build
    from blink.engine.engine import Engine, EngineConfig

    def engine():
        return Engine(EngineConfig(model=str(checkpoint(kind)), max_num_seqs=4, max_num_batched_tokens=64,
                                   num_pages=64, page_size=8, max_model_len=128))

    prompts = [[5, 6, 7, 8], list(range(10, 60)), [99] * 7, [42, 43]]
    results = {}
    for mode in ("host", "graph"):
        table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(4, 128, 8, page_size=8))
        try:
            driver = build(mode, engine(), table)  # one interface: each steps by itself once started
            driver.start()
            for slot, prompt in enumerate(prompts):
                table.publish(slot, Request(prompt, 12, temperature=0.0, ignore_eos=True))
            tokens = {slot: [] for slot in range(len(prompts))}
            deadline = time.monotonic() + 60
            while not all(table.slots["state"][: len(prompts)] == 3) and time.monotonic() < deadline:
                time.sleep(0.001)
                for slot in tokens:
                    tokens[slot] += table.read(slot).tokens
            for slot in tokens:
                tokens[slot] += table.read(slot).tokens
            results[mode] = tokens
            driver.stop()
            assert driver.failure is None and driver.resident == 0
            if mode == "graph":
                assert driver.replays > 0
            driver.close()
        finally:
            table.unlink()
    assert results["graph"] == results["host"]
    assert all(len(t) == 12 for t in results["host"].values())


def _until(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_host_driver_steps_by_itself_behind_the_driver_interface(tiny_engine, small_table):
    """What the engine service uses of any driver: start, the admission limit, resident, stop, failure."""
    from blink.engine.drive.driver import Fenced
    from blink.engine.drive.modes import build

    table = small_table
    driver = build("host", tiny_engine(), table)
    assert driver.mode == "host" and driver.limitations == () and driver.mirror is not None
    driver.set_admission_limit(0)
    driver.start()
    try:
        table.publish(0, Request([5, 6, 7], 2, temperature=0.0, ignore_eos=True))
        time.sleep(0.2)
        assert table.slots["state"][0] == 1 and driver.resident == 0  # held back: the limit is 0
        driver.set_admission_limit(None)
        _until(lambda: table.slots["state"][0] == 3)
        assert len(table.read(0).tokens) == 2 and driver.resident == 0
        steps = int(table.header["steps"])
        _until(lambda: int(table.header["steps"]) > steps)  # idle, it still beats
        table.fail_over()  # the watchdog gave the table to another engine
        _until(lambda: driver.failure is not None)
        assert isinstance(driver.failure, Fenced)
    finally:
        driver.stop()
        driver.close()


def test_the_device_modes_rotate_kv_through_the_engines_mirror(tiny_engine, small_table):
    """The device step plans page moves with the engine's host mirror and copies them itself: no limitation left
    to list (the pinned memory of --swap-space is taken, as in the host mode)."""
    from blink.engine.drive.device_step import LIMITATIONS, DeviceStep

    engine = tiny_engine()
    step = DeviceStep(engine, small_table)
    try:
        assert step.mirror is engine.mirror is not None and LIMITATIONS == ()
    finally:
        step.close()


def test_the_device_modes_step_only_when_a_step_has_work(small_table):
    """No step while every resident request waits for its reader (the graph loop's `idle()`; the persistent loop's
    pick kernel checks the same on the device): a step is due for tokens the device wants, a published request, or
    an admitted one whose reader made room or which was cancelled. The service vouches for an idle driver to the
    watchdog (without that, a slow reader read as a stalled engine after the deadline)."""
    from types import SimpleNamespace

    import torch

    from blink.engine.drive.device_grammars import READY
    from blink.engine.drive.device_step import DeviceDriver
    from blink.shared.grammar import GrammarKind

    driver = object.__new__(DeviceDriver)
    driver.table = small_table
    driver.step = SimpleNamespace(demand=torch.zeros(2, dtype=torch.int64), limit=torch.full((1,), 4),
                                  grammars=SimpleNamespace(ready=torch.zeros(4, dtype=torch.int32)))

    def due() -> bool:
        return not driver.idle()

    assert not due()
    small_table.publish(0, Request([1, 2], 8))
    assert due()
    driver.step.limit[0] = 0  # drained: a published request waits for the limit, not for a step
    assert not due()
    driver.step.limit[0] = 4
    small_table.admit(0)
    assert due()  # admitted, its window empty
    for token in range(3):  # the window holds 3
        small_table.emit(0, token)
    assert not due()  # resident, waiting for its reader
    driver.step.demand[0] = 1
    assert due()  # the device wants tokens
    driver.step.demand[0] = 0
    small_table.read(0)
    assert due()
    for token in range(3):
        small_table.emit(0, token)
    small_table.cancel(0)
    assert due()  # the step ends it
    small_table.slots[0]["epoch"] = int(small_table.header["epoch"]) - 1
    assert not due()  # an older epoch's slot is the ingress's to reclaim, not work
    small_table.publish(1, Request([1, 2], 8, grammar_kind=int(GrammarKind.REGEX), grammar="[a-z]+"))
    assert not due()  # a structured output waits for the grammar gate to put its table on the device
    driver.step.grammars.ready[1] = READY
    assert due()
