"""Fault injection against `blink serve` and its watchdog: a killed or stopped engine, a killed ingress.

Across all of it: every stream ends with exactly one terminal event (a finish reason or an error event) and
never hangs, no slot leaks, and the deployment serves again without anyone restarting it by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq

from blink.bench.lib.server import running_server
from blink.shared import control, sockets
from blink.shared.slot_table import EngineState, Geometry, SlotState, SlotTable
from tests.support.deployment import (
    DEADLINE_S,
    MODEL,
    SLACK_S,
    decoding,
    engine_pid,
    gone,
    stream,
    table_empty,
    wait_ready_and_serving,
    wait_until,
)

pytestmark = pytest.mark.slow  # whole deployments (blink serve): CI runs them; `-m "not slow"` skips them

FLAGS = ("--watchdog-deadline", str(DEADLINE_S), "--max-num-seqs", "16", "--max-num-batched-tokens", "64")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("watchdog"), *FLAGS) as server:
        yield server


@pytest.fixture
def table(server):
    table = SlotTable.attach(server.deployment)
    yield table
    table.close()


def run_and_kill(server, table, prompts, max_tokens: int, when, sig=signal.SIGKILL):
    """Starts 16 streams, sends `sig` to the engine once `when(table)` holds, returns (results, kill time)."""
    pid = engine_pid(server)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, server.url, p, max_tokens) for p in prompts]
        wait_until(lambda: when(table), 60, "the phase to kill in")
        killed_at = time.monotonic()
        os.kill(pid, sig)
        results = [f.result(timeout=60) for f in futures]
    return results, killed_at, pid


# 1,500 tokens each, all different from their first page (no prefix cache hit): 16 of them take ~375 steps of prefill
# at 64 tokens a step (one shared prompt was cached after the first and all 16 ran in half a second, under the poll).
LONG_PROMPTS = [[5 + (97 * i + j) % 1000 for j in range(1500)] for i in range(16)]


@pytest.mark.parametrize("phase", ["queued", "prefilling", "decoding", "finishing"])
def test_sigkill_the_engine(server, table, phase):
    wait_ready_and_serving(server)
    states, produced = table.slots["state"], table.slots["produced"]
    if phase == "queued":  # the engine admits nothing: every request waits in its slot
        assert isinstance(server.request(server.control_endpoint, control.SetLimits(max_running=0)), control.Ack)
        prompts, max_tokens = ["a queued request"] * 16, 8
        when = lambda t: (states == SlotState.SUBMITTED).sum() == 16  # noqa: E731
    elif phase == "prefilling":
        # Killed while most prompts are still prefilling: the first may be through before the last arrives.
        prompts, max_tokens = LONG_PROMPTS, 8
        when = lambda t: ((states == SlotState.ADMITTED) & (produced == 0)).sum() >= 8  # noqa: E731
    elif phase == "decoding":
        prompts, max_tokens = ["decode for a long time"] * 16, 1500
        when = decoding(table, 16)
    else:  # some have finished, the rest are about to (16 steps from the end: a window the 20 ms poll sees)
        prompts, max_tokens = [f"finish soon {i}" for i in range(16)], 64
        when = lambda t: ((states == SlotState.FINISHED).any()  # noqa: E731
                          or ((states == SlotState.ADMITTED) & (produced >= 48)).any())

    results, killed_at, pid = run_and_kill(server, table, prompts, max_tokens, when)

    for r in results:
        assert r.done and r.terminal_events == 1, r  # exactly one terminal event, and the stream closed
    if phase == "queued":  # never admitted: resubmitted to the restarted engine, so they complete
        assert all(r.finish_reasons == ["length"] and r.tokens == 8 for r in results), results
    else:
        failed = [r for r in results if r.errors]
        assert failed or phase == "finishing"
        for r in failed:
            assert r.errors[0]["code"] == "engine_failure"
            assert r.ended_at - killed_at < DEADLINE_S + SLACK_S
    wait_ready_and_serving(server)
    assert engine_pid(server) != pid
    wait_until(lambda: table_empty(table), 10, "every slot to be free again")


def test_an_engine_stopped_alone_hands_its_table_to_the_next(server, table):
    """SIGTERM to the engine (not to blink serve): its requests end with errors, the ingress stays attached to
    the same table, and the restarted engine takes that table over."""
    wait_ready_and_serving(server)
    inode = SlotTable.path_for(server.deployment).stat().st_ino
    results, stopped_at, pid = run_and_kill(server, table, ["stop gracefully"] * 4, 1500, decoding(table, 4),
                                            signal.SIGTERM)
    for r in results:
        assert r.done and r.terminal_events == 1 and r.errors[0]["code"] == "engine_failure"
        assert r.ended_at - stopped_at < DEADLINE_S + SLACK_S
    wait_ready_and_serving(server)
    assert engine_pid(server) != pid and SlotTable.path_for(server.deployment).stat().st_ino == inode
    wait_until(lambda: table_empty(table), 10, "every slot to be free again")


def test_sigstop_the_engine_is_a_stall(server, table):
    wait_ready_and_serving(server)
    events = zmq.Context.instance().socket(zmq.SUB)
    events.setsockopt(zmq.SUBSCRIBE, b"")
    sockets.connect(events, server.endpoint("events"), server.keys)
    pid = engine_pid(server)
    try:
        results, stopped_at, _ = run_and_kill(server, table, ["stall"] * 16, 1500, decoding(table, 16),
                                              signal.SIGSTOP)
        assert all(r.errors and r.errors[0]["code"] == "engine_failure" and r.terminal_events == 1
                   for r in results)
        assert all(r.ended_at - stopped_at < DEADLINE_S + SLACK_S for r in results)
        assert events.poll(5000)
        event = json.loads(events.recv())
        assert event["event"] == "engine_failed" and event["reason"].startswith("stalled")
    finally:
        events.close()
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGCONT)  # the watchdog killed it; if not, do not leave it stopped
    wait_ready_and_serving(server)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "blink:engine_failovers_total" in metrics and "blink:degraded" in metrics
    wait_until(lambda: table_empty(table), 10, "every slot to be free again")


def test_a_step_longer_than_the_deadline_is_alive_while_its_layers_go_by(tmp_path):
    """A prefill step of seconds (a large model on the CPU) is not a stall: the service vouches for the engine while
    the step's sublayers go by. (It was one: a 1.1B Llama's 500-token prompt on two cores failed the engine over.)"""
    from blink.engine.model.tiny_model import ensure_tiny_model

    tiny, model, deadline_s = ensure_tiny_model(), tmp_path / "model", 0.5
    model.mkdir()
    shutil.copy(tiny / "tokenizer.json", model)
    config = json.loads((tiny / "config.json").read_text())  # wider, deeper: 32 sublayers of ~0.1 s here
    config.update(hidden_size=1024, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=4)
    (model / "config.json").write_text(json.dumps(config))
    with running_server(tmp_path, "--model", str(model), "--load-format", "dummy", "--served-model-name", MODEL,
                        "--watchdog-deadline", str(deadline_s), "--max-num-seqs", "2",
                        "--max-num-batched-tokens", "1024") as server:
        pid = engine_pid(server)
        body = {"model": MODEL, "prompt": [5 + i % 1000 for i in range(1000)], "max_tokens": 2, "ignore_eos": True}
        started = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        took = time.monotonic() - started
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert engine_pid(server) == pid
        if took < 2 * deadline_s:
            pytest.skip(f"this machine ran the prompt's step in {took:.2f} s, within the deadline: nothing to check")


def test_sigkill_the_ingress(server, table):
    wait_ready_and_serving(server)
    status = server.request(server.endpoint("ingress"), control.Ping(), timeout_s=5)
    assert isinstance(status, control.IngressStatus)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, server.url, "orphan me", 1500) for _ in range(8)]
        wait_until(decoding(table, 8), 60, "8 decoding requests")
        os.kill(status.pid, signal.SIGKILL)
        for f in futures:
            with pytest.raises(httpx.HTTPError):  # their connections died with the ingress
                f.result(timeout=30)
    # blink serve holds the port: a request that comes while the ingress restarts waits for it, and is answered
    body = {"model": MODEL, "prompt": "after the restart", "max_tokens": 2, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    wait_ready_and_serving(server)
    restarted = server.request(server.endpoint("ingress"), control.Ping(), timeout_s=5)
    assert restarted.pid != status.pid
    wait_until(lambda: table_empty(table), 10, "the engine to abort the orphans and the ingress to free them")


def test_serve_refuses_a_port_in_use_before_it_loads_anything(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "blink.services.cli", "serve", "--port", str(port),
                               "--runtime-dir", str(tmp_path), "--deployment", f"busy-{port}"],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "engine" not in done.stdout + done.stderr


def test_sigterm_to_serve_drains_then_stops_everything_in_order(tmp_path):
    with running_server(tmp_path, "--shutdown-timeout", "20") as server:
        engine = engine_pid(server)
        ingress = server.request(server.endpoint("ingress"), control.Ping(), timeout_s=5).pid
        segment = SlotTable.path_for(server.deployment)
        assert segment.exists()
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            server.process.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{server.url}/ready").status_code == 503, 5, "/ready to answer 503")
            refused = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]  # finished, not cut
        assert server.process.wait(60) == 0
        for pid in (engine, ingress):
            assert gone(pid), "a service outlived blink serve"
        assert not segment.exists(), "the shared-memory segment was left behind"


def test_standalone_watchdog_kills_a_stalled_engine_for_the_orchestrator_to_restart(tmp_path):
    """As under compose: the services run on their own and the watchdog did not start them."""
    import subprocess
    import sys
    import uuid

    from blink.bench.lib.server import Server, free_port
    from blink.shared.settings import Settings
    from blink.shared.sockets import write_key

    deployment, port = f"test-{uuid.uuid4().hex[:10]}", free_port()
    write_key(tmp_path / "control.key")  # provisioned, as a compose secret is
    flags = ["--deployment", deployment, "--runtime-dir", str(tmp_path), "--port", str(port),
             "--watchdog-deadline", str(DEADLINE_S), "--control-key-file", str(tmp_path / "control.key")]
    log = open(tmp_path / "services.log", "w")  # noqa: SIM115 - closed below

    def start(service: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "blink.services.cli", service, *flags], stdout=log,
                                stderr=subprocess.STDOUT)

    events = zmq.Context.instance().socket(zmq.SUB)
    events.setsockopt(zmq.SUBSCRIBE, b"")
    events.setsockopt(zmq.RCVTIMEO, 30_000)
    procs = {name: start(name) for name in ("engine", "ingress", "watchdog")}
    try:
        server = Server(f"http://127.0.0.1:{port}", procs["ingress"], Settings(
            deployment=deployment, runtime_dir=str(tmp_path), control_key_file=str(tmp_path / "control.key")))
        sockets.connect(events, server.endpoint("events"), server.keys)
        wait_ready_and_serving(server)
        seen = [json.loads(events.recv())["event"] for _ in range(2)]
        assert sorted(seen) == ["engine_ready", "ingress_ready"]
        table = SlotTable.attach(deployment)
        try:
            results, stopped_at, _ = run_and_kill(server, table, ["stall"] * 4, 1500, decoding(table, 4),
                                                  signal.SIGSTOP)
        finally:
            table.close()
        assert all(r.errors and r.errors[0]["code"] == "engine_failure" for r in results)
        assert all(r.ended_at - stopped_at < DEADLINE_S + SLACK_S for r in results)
        failed = json.loads(events.recv())
        assert failed["event"] == "engine_failed" and failed["reason"].startswith("stalled")
        assert procs["engine"].wait(10) == -signal.SIGKILL  # killed by the watchdog, by pid
        procs["engine"] = start("engine")  # the orchestrator's restart policy
        wait_ready_and_serving(server)
        assert json.loads(events.recv())["event"] == "engine_ready"
    finally:
        events.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                proc.wait(30)
        log.close()


def test_sigstop_the_ingress_is_a_stall(server, table):
    wait_ready_and_serving(server)
    stopped = server.request(server.endpoint("ingress"), control.Ping(), timeout_s=5).pid
    stopped_at = time.monotonic()
    os.kill(stopped, signal.SIGSTOP)
    try:
        wait_until(lambda: gone(stopped), DEADLINE_S + SLACK_S + 2, "the watchdog to kill the stopped ingress")
        # Not before the deadline, counted from the last answer (a ping every tick or two of 0.1 s).
        assert time.monotonic() - stopped_at > DEADLINE_S - 0.3
    finally:
        if os.path.exists(f"/proc/{stopped}"):
            os.kill(stopped, signal.SIGCONT)
    wait_ready_and_serving(server)
    wait_until(lambda: table_empty(table), 10, "every slot to be free again")


def test_killing_blink_serve_leaves_nothing_behind(tmp_path):
    with running_server(tmp_path) as server:
        children = [engine_pid(server), server.request(server.endpoint("ingress"), control.Ping(), timeout_s=5).pid]
        server.process.kill()
        server.process.wait(10)
        wait_until(lambda: all(map(gone, children)), 30, "the engine and the ingress to stop with their parent")
        assert not SlotTable.path_for(server.deployment).exists()


def test_a_standalone_watchdog_can_kill_an_engine_that_hangs_before_its_handshake(tmp_path):
    """Under compose the watchdog learns an engine's pid from its handshake, which an engine hung loading never
    makes: the pid file the engine writes as it starts names it, if that process is a Blink engine still."""
    import subprocess
    import sys

    from blink.services.watchdog import ENGINE, PidSupervisor

    pid_file = tmp_path / "engine.pid"
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "blink", "engine"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for proc in (hung, other):  # their own command lines, not the parent's (read before their exec, under load)
            wait_until(lambda proc=proc: b"-c" in Path(f"/proc/{proc.pid}/cmdline").read_bytes(), 10, "an exec")
        pid_file.write_text(str(other.pid))  # a stale file whose pid another process took
        PidSupervisor(pid_file).kill(ENGINE)
        assert other.poll() is None
        pid_file.write_text(str(hung.pid))
        PidSupervisor(pid_file).kill(ENGINE)
        wait_until(lambda: hung.poll() is not None, 10, f"a kill of {Path(f'/proc/{hung.pid}/cmdline').read_bytes()!r}")
        assert hung.returncode == -signal.SIGKILL
    finally:
        for proc in (hung, other):
            proc.kill()
            proc.wait()


def test_the_engine_writes_its_pid_file_as_it_starts_and_removes_it(tmp_path, monkeypatch):
    from blink.services import engine_service
    from blink.shared.settings import Settings

    settings = Settings(deployment="pidfile", runtime_dir=str(tmp_path))
    seen = []

    class Service:
        def __init__(self, settings):
            seen.append(settings.engine_pid_file.read_text())

        def run(self):
            pass

    monkeypatch.setattr(engine_service, "EngineService", Service)
    engine_service.run_engine(settings)
    assert seen == [str(os.getpid())] and not settings.engine_pid_file.exists()


def test_an_engine_restarted_with_another_table_geometry_is_served_again(tmp_path):
    """The engine dies and its successor sizes its context limit from the memory it finds free, smaller: its table
    has another geometry, so it makes a new file (here the new geometry is laid down by the test, as such an engine
    would leave it). The ingress, which maps the old file, ends its streams with the engine's failure, drains and
    is started again by the watchdog; then the deployment serves."""
    with running_server(tmp_path, *FLAGS) as server:
        wait_ready_and_serving(server)
        table = SlotTable.attach(server.deployment)
        g = table.geometry
        pid = engine_pid(server)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, server.url, "decode for a long time", 1500) for _ in range(4)]
            wait_until(lambda: decoding(table, 4)(), 60, "four streams decoding")
            os.kill(pid, signal.SIGKILL)
            table.close()
            table.path.unlink()
            other = SlotTable.create(server.deployment, Geometry(g.num_slots, g.max_prompt_tokens // 2, g.window,
                                                                 page_size=g.page_size, prefix_seed=g.prefix_seed))
            other.header["engine_state"] = EngineState.STOPPED  # a dead engine's: the next one replaces it
            other.close()
            results = [f.result(timeout=60) for f in futures]
        for r in results:
            assert r.done and r.terminal_events == 1 and r.errors[0]["code"] == "engine_failure", r
        wait_ready_and_serving(server)
        log = next(server.runtime_dir.glob("serve-*.log")).read_text()
        assert "slot table replaced" in log and "ingress_failed" in log
