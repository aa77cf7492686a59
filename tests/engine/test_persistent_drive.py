"""The `persistent` drive mode: the step loop on the device, as CUDA graph conditional nodes. Without a GPU, the
reasons it is unavailable; with one, that it serves the slot table as the host driver does, across stops."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from blink.engine.drive import persistent as persistent_drive
from blink.engine.drive.device_step import DeviceStep
from blink.engine.drive.host import HostDriver
from blink.engine.drive.persistent import PersistentDriver, PersistentUnavailable, unavailable_reason
from blink.shared.slot_table import Finish, Request, SlotTable

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's reason")

GREEDY = {
    0: Request([5, 6, 7, 8], 6, temperature=0.0, ignore_eos=True, logprobs=2),
    1: Request(list(range(10, 45)), 5, temperature=0.0, ignore_eos=True),  # prefilled over several steps
    2: Request([99] * 7, 7, temperature=0.0, top_k=20, ignore_eos=True),
    3: Request([42, 43], 9, temperature=0.0, stop_token_ids=(7,), repetition_penalty=1.3),
}
LONG = {slot: Request([3 + slot, 4, 5], 40, temperature=0.0, ignore_eos=True) for slot in range(4)}

Served = dict[int, tuple[list[int], Finish]]


@pytest.fixture
def table(small_table):
    return small_table


# -- without a GPU: why not ------------------------------------------------------------------------------------


@cpu_only
def test_without_cuda_the_reason_says_so():
    reason = unavailable_reason()
    assert reason is not None and "CUDA" in reason


@cpu_only
def test_a_cpu_engine_is_refused_with_the_reason(tiny_engine, table):
    step = DeviceStep(tiny_engine(), table)
    with pytest.raises(PersistentUnavailable, match="CUDA"):
        PersistentDriver(step, table)
    step.close()


def test_without_cuda_python_the_reason_says_how_to_install(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cuda", None)  # nothing under `cuda` imports
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    assert "pip install 'blink-serve[cuda]'" in unavailable_reason()


def _fake_cuda(monkeypatch, bindings: tuple[int, int], driver: int, runtime: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    versions = SimpleNamespace(cudaDriverGetVersion=lambda: (0, driver), cudaRuntimeGetVersion=lambda: (0, runtime))
    fake = persistent_drive._Cuda(SimpleNamespace(), versions, SimpleNamespace(), bindings)
    monkeypatch.setattr(persistent_drive, "_bindings", lambda: fake)


@pytest.mark.parametrize(("bindings", "driver", "runtime", "reason"), [
    ((12, 3), 12080, 12080, "cuda-python 12.3 predates"),
    ((12, 8), 12020, 12080, "the driver supports CUDA 12.2"),
    ((12, 8), 12080, 12030, "the runtime is 12.3"),
    ((13, 0), 12090, 13000, "needs a CUDA 13 driver"),
])
def test_old_cuda_is_refused_with_its_versions(monkeypatch, bindings, driver, runtime, reason):
    _fake_cuda(monkeypatch, bindings, driver, runtime)
    assert reason in unavailable_reason()


def test_a_gpu_without_nanosleep_is_refused(monkeypatch):
    _fake_cuda(monkeypatch, (12, 8), 12080, 12080)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (6, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tesla P100")
    assert "compute capability 7.0+; Tesla P100 is 6.0" in unavailable_reason()


# -- with a GPU: the loop itself ------------------------------------------------------------------------------


@pytest.fixture
def persistent(tiny_engine, table):
    step = DeviceStep(tiny_engine(), table)
    try:
        driver = PersistentDriver(step, table)
    except PersistentUnavailable as e:
        step.close()
        pytest.skip(f"the persistent mode is unavailable here: {e}")
    yield driver
    driver.close()
    step.close()


def _read(table: SlotTable, got: Served) -> None:
    for slot, (tokens, finish) in got.items():
        out = table.read(slot)
        got[slot] = (tokens + out.tokens, out.finish or finish)


def _finished(got: Served) -> bool:
    return all(finish for _, finish in got.values())


def _read_until(table: SlotTable, got: Served, done: Callable[[], bool], seconds: float = 60.0) -> None:
    """Reads like an ingress, every millisecond: the 3-token window pauses slots between reads."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _read(table, got)
        if done():
            return
        time.sleep(1e-3)
    raise AssertionError(f"not done after {seconds} s: {got}")


def _host_reference(tiny_engine, table: SlotTable, requests: dict[int, Request]) -> Served:
    """What the host driver serves for `requests`; frees their slots again."""
    driver = HostDriver(tiny_engine(), table)
    for slot, request in requests.items():
        table.publish(slot, request)
    got = {slot: ([], Finish.NONE) for slot in requests}
    for _ in range(1000):
        driver.step()
        _read(table, got)
        if _finished(got):
            break
    for slot in requests:
        table.free(slot)
    return got


@pytest.mark.gpu
def test_the_loop_serves_the_table_as_the_host_driver_does(tiny_engine, table, persistent):
    expected = _host_reference(tiny_engine, table, GREEDY)
    assert _finished(expected)
    persistent.start()
    for slot, request in GREEDY.items():
        table.publish(slot, request)
    got = {slot: ([], Finish.NONE) for slot in GREEDY}
    _read_until(table, got, lambda: _finished(got))
    assert got == expected

    time.sleep(0.05)  # nothing resident, nothing submitted: the loop naps instead of stepping
    steps = int(table.header["steps"])
    time.sleep(0.05)
    assert int(table.header["steps"]) == steps and persistent.resident == 0
    table.free(0)
    table.publish(0, GREEDY[0])  # and wakes for a new request
    again = {0: ([], Finish.NONE)}
    _read_until(table, again, lambda: _finished(again), seconds=5.0)
    assert again[0] == expected[0]
    persistent.stop()
    assert persistent.launches == 1


@pytest.mark.gpu
def test_stopping_and_restarting_the_loop_loses_no_token(tiny_engine, table, persistent):
    expected = _host_reference(tiny_engine, table, LONG)
    for slot, request in LONG.items():
        table.publish(slot, request)
    got = {slot: ([], Finish.NONE) for slot in LONG}
    for tokens in (5, 15, 25):
        persistent.start()
        _read_until(table, got, lambda tokens=tokens: min(len(t) for t, _ in got.values()) >= tokens)
        persistent.stop()  # with every request in flight
        assert persistent.resident == len(LONG)
        produced = table.slots["produced"].copy()
        time.sleep(0.05)
        assert (table.slots["produced"] == produced).all()  # stopped: nothing more is written
    persistent.start()
    _read_until(table, got, lambda: _finished(got))
    persistent.stop()
    assert got == expected
    assert all(len(tokens) == 40 and finish == Finish.LENGTH for tokens, finish in got.values())
    assert persistent.launches == 4


@pytest.mark.gpu
def test_what_the_service_asks_of_a_running_loop_never_waits_for_it(tiny_engine, table, persistent):
    """While the loop runs, any context-wide sync (torch.cuda.synchronize, a cudaFree, an allocator retry) waits
    for a kernel that never ends (measured on an H100: such a sync returns only after stop()). What the engine
    service does during the loop (resident, the admission limit, failure) must answer at once, and tokens keep
    flowing while it does."""
    long = {slot: Request([3 + slot, 4, 5], 60, temperature=0.0, ignore_eos=True) for slot in range(4)}
    for slot, request in long.items():
        table.publish(slot, request)
    got = {slot: ([], Finish.NONE) for slot in long}
    persistent.start()
    _read_until(table, got, lambda: min(len(t) for t, _ in got.values()) >= 5)
    answers: list = []

    def ask() -> None:
        answers.append(persistent.resident)
        persistent.set_admission_limit(2)
        persistent.set_admission_limit(None)
        answers.append(persistent.failure)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(2.0)
    assert not asking.is_alive(), "a service call waited on the running loop"
    assert answers == [4, None]
    _read_until(table, got, lambda: _finished(got))
    persistent.stop()
    assert all(len(tokens) == 60 for tokens, _ in got.values())
