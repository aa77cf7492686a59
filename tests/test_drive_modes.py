"""Choosing the drive mode, the fallback when a mode cannot run, and (on a GPU) the `graph` mode's tokens."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import torch

from blink.bench.server import running_server
from blink.engine.drive_modes import candidates
from blink.shared.slot_table import Geometry, Request, SlotTable

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_cpu_runs_the_host_mode_and_says_why_not_the_others():
    modes, reasons = candidates("auto", torch.device("cpu"))
    assert modes == ["host"]
    assert [r.split(":")[0] for r in reasons] == ["persistent", "graph"]
    assert all("CUDA" in r for r in reasons)
    assert candidates("graph", torch.device("cpu"))[0] == ["host"]
    assert candidates("host", torch.device("cpu")) == (["host"], [])


def test_serve_asked_for_persistent_on_the_cpu_runs_host_and_reports_it(tmp_path):
    with running_server(tmp_path, "--drive", "persistent") as server:
        assert httpx.get(f"{server.url}/ready").json()["drive"] == "host"
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'blink:engine_info{drive="host"' in metrics
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "blink-tiny-llama-v1", "prompt": "Hi",
                                                              "max_tokens": 2, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200
    log = "".join(p.read_text() for p in tmp_path.glob("serve-*.log"))
    assert "drive mode unavailable" in log and "needs a CUDA device" in log


@needs_cuda
@pytest.mark.gpu
def test_graph_mode_gives_the_host_modes_greedy_tokens(checkpoint):
    from blink.engine.device_step import DeviceStep
    from blink.engine.engine import Engine, EngineConfig
    from blink.engine.graph_drive import GraphDriver
    from blink.engine.table_drive import TableDriver

    def engine():
        return Engine(EngineConfig(model=str(checkpoint("qwen3")), max_num_seqs=4, max_num_batched_tokens=64,
                                   num_pages=64, page_size=8, max_model_len=128))

    prompts = [[5, 6, 7, 8], list(range(10, 60)), [99] * 7, [42, 43]]
    results = {}
    for mode in ("host", "graph"):
        table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(4, 128, 8))
        try:
            if mode == "host":
                driver = TableDriver(engine(), table)
                step = driver.step
            else:
                driver = GraphDriver(DeviceStep(engine(), table), table)
                driver.start()
                step = lambda: time.sleep(0.001)  # noqa: E731 - the device steps by itself
            for slot, prompt in enumerate(prompts):
                table.publish(slot, Request(prompt, 12, temperature=0.0, ignore_eos=True))
            tokens = {slot: [] for slot in range(len(prompts))}
            deadline = time.monotonic() + 60
            while not all(table.slots["state"][: len(prompts)] == 3) and time.monotonic() < deadline:
                step()
                for slot in tokens:
                    tokens[slot] += table.read(slot).tokens
            for slot in tokens:
                tokens[slot] += table.read(slot).tokens
            results[mode] = tokens
            if mode == "graph":
                driver.stop()
                assert driver.replays > 0
                driver.close()
        finally:
            table.unlink()
    assert results["graph"] == results["host"]
    assert all(len(t) == 12 for t in results["host"].values())
