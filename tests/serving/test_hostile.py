"""Hostile input against `blink serve` with an API key: huge and stalled bodies, strangers on the control plane,
clients without the key. One authenticated stream runs through all of it and must come out whole; after each
attack a normal request succeeds, /ready is 200 and no service was restarted.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import zmq

from blink.bench.lib.server import free_port, running_server
from blink.ingress.zmq_client import BlinkError, Client
from blink.shared import control, sockets
from blink.shared.slot_table import SlotTable

pytestmark = pytest.mark.slow  # whole deployments (blink serve): CI runs them; `-m "not slow"` skips them

MODEL = "blink-tiny-llama-v1"
KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
REQUEST_TIMEOUT_S = 2.0
STREAM_TOKENS = 2000  # read at 20 tokens a second until told: it outlasts every test here


@dataclass
class LongStream:
    """An authenticated stream read slowly (the engine pauses it while its window is full) until told to finish."""

    url: str
    finish: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0
    events: list[dict] = field(default_factory=list)
    done: bool = False
    error: BaseException | None = None
    ended_at: float = 0.0

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line.removeprefix("data: "))
                        self.events.append(event)
                        if not self.finish.is_set():
                            time.sleep(0.05)
        except BaseException as e:  # reported by the last test
            self.error = e
        self.ended_at = time.monotonic()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    ports = {name: free_port() for name in ("control", "relay", "zmq")}
    with running_server(tmp_path_factory.mktemp("hostile"), "--api-key", KEY,
                        "--request-timeout", str(REQUEST_TIMEOUT_S),
                        "--control-port", str(ports["control"]), "--relay-port", str(ports["relay"]),
                        "--zmq-port", str(ports["zmq"]), "--max-num-seqs", "4") as server:
        server.ports = ports
        server.pids = _service_pids(server)
        stream = LongStream(server.url)
        thread = threading.Thread(target=stream.run, daemon=True)
        thread.start()
        server.stream = stream
        _wait(lambda: len(stream.events) >= 3, 60, "the long stream to start")
        yield server
        stream.finish.set()
        thread.join(120)


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _service_pids(server) -> dict[str, int]:
    engine = server.request(server.control_endpoint, control.Hello(), timeout_s=5).pid
    ingress = server.request(server.endpoint("ingress"), control.Ping(), timeout_s=5).pid
    return {"engine": engine, "ingress": ingress}


def _still_serving(server) -> None:
    """A normal request succeeds, /ready is 200, the long stream still runs and no service was restarted."""
    ready = httpx.get(f"{server.url}/ready", timeout=5)
    assert ready.status_code == 200, ready.text
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert _service_pids(server) == server.pids
    assert ready.json()["failovers"] == 0
    assert server.stream.error is None and not server.stream.done


@pytest.mark.parametrize("size", [5 << 20, 50 << 20], ids=["5MiB", "50MiB"])
def test_huge_bodies_are_refused_before_they_are_read(deployment, size):
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * size + b'"}'
    for route in POST_ROUTES:
        start = time.monotonic()
        r = httpx.post(f"{deployment.url}{route}", content=body, timeout=30,
                       headers=AUTH | {"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", (route, r.text[:200])
        assert time.monotonic() - start < 5
    _still_serving(deployment)


def test_a_huge_chunked_body_is_cut_off(deployment):
    """No Content-Length to go by: the bytes are counted as they arrive."""

    def chunks():
        for _ in range(64):
            yield b"a" * (1 << 20)

    r = httpx.post(f"{deployment.url}/tokenize", content=chunks(), timeout=30,
                   headers=AUTH | {"content-type": "application/json"})
    assert r.status_code == 413
    _still_serving(deployment)


def test_a_prompt_longer_than_the_context_is_refused_without_tokenizing_it(deployment):
    start = time.monotonic()
    r = httpx.post(f"{deployment.url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "prompt": "once upon a time " * 200_000})  # 3.4 MB, under the body limit
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert time.monotonic() - start < 2
    _still_serving(deployment)


def test_large_legitimate_work_runs_off_the_event_loop(deployment):
    """Four 3 MB texts tokenized at once (seconds of work): the stream and the watchdog's pings go on meanwhile."""
    text = "the quick brown fox jumps over the lazy dog " * 70_000

    def tokenize() -> int:
        r = httpx.post(f"{deployment.url}/tokenize", headers=AUTH, json={"prompt": text}, timeout=120)
        assert r.status_code == 200
        return r.json()["count"]

    before = len(deployment.stream.events)
    results: list[int] = []
    workers = [threading.Thread(target=lambda: results.append(tokenize())) for _ in range(4)]
    for w in workers:
        w.start()
    pings = []
    ping = zmq.Context.instance().socket(zmq.REQ)  # as the watchdog pings: one socket, a ping at a time
    ping.setsockopt(zmq.LINGER, 0)
    sockets.connect(ping, deployment.endpoint("ingress"), deployment.keys)
    while any(w.is_alive() for w in workers):
        start = time.monotonic()
        ping.send(control.encode(control.Ping()))
        assert ping.poll(5000)
        ping.recv()
        pings.append(time.monotonic() - start)
        time.sleep(0.1)
    ping.close()
    assert len(results) == 4 and len(set(results)) == 1
    assert max(pings) < 1.0, pings  # the watchdog's deadline is 2 s
    assert len(deployment.stream.events) > before  # tokens kept flowing
    _still_serving(deployment)


def test_a_stalled_body_is_dropped(deployment):
    host, port = deployment.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S + 10) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ".encode())
        start = time.monotonic()
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert REQUEST_TIMEOUT_S - 0.5 < time.monotonic() - start < REQUEST_TIMEOUT_S + 3
    _still_serving(deployment)


def test_trickled_headers_and_a_silent_connection_are_cut_off(deployment):
    host, port = deployment.url.removeprefix("http://").split(":")
    for opening in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b""):  # half the headers; nothing at all
        with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S + 10) as conn:
            conn.sendall(opening)
            start = time.monotonic()
            assert conn.recv(65536) == b""  # closed, without an answer
        assert time.monotonic() - start < REQUEST_TIMEOUT_S + 3
    _still_serving(deployment)


def test_every_client_entry_point_wants_the_key(deployment):
    for route in POST_ROUTES:
        r = httpx.post(f"{deployment.url}{route}", json={"prompt": "hi", "tokens": [1]}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", route
    assert httpx.get(f"{deployment.url}/v1/models", timeout=10).status_code == 401
    for route in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{deployment.url}{route}", timeout=10).status_code == 200, route
    schema = httpx.get(f"{deployment.url}/openapi.json", timeout=10).json()
    assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert schema["paths"]["/tokenize"]["post"]["security"] == [{"apiKey": []}]
    assert "security" not in schema["paths"]["/health"]["get"]

    endpoint = f"tcp://127.0.0.1:{deployment.ports['zmq']}"
    for key in (None, "wrong"):
        client = Client(endpoint, timeout_s=10, api_key=key)
        with pytest.raises(BlinkError) as refused:
            client.generate("Hello", max_tokens=2)
        client.close()
        assert refused.value.error["code"] == "invalid_api_key"
    client = Client(endpoint, timeout_s=30, api_key=KEY)
    assert len(client.generate("Hello", max_tokens=2, ignore_eos=True).token_ids) == 2
    client.close()
    _still_serving(deployment)


def _stranger(endpoint: str, frames: list[bytes], kind: int, server_key: bytes | None) -> bool:
    """Sends what a stranger would: with no key (NULL), or, knowing the server's public key, with a key pair of its
    own (CURVE). True if anything came back."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    try:
        for frame in frames:
            sock.send(frame)
        return bool(sock.poll(1000))
    finally:
        sock.close()


def test_strangers_on_the_control_plane_change_nothing(deployment):
    orders = [control.encode(m) for m in (control.SetLimits(max_running=0), control.Drain(), control.Stop(),
                                          control.Hello())]
    relay_frames = [json.dumps({"op": "submit", "id": "x", "request": {"prompt": [1, 2], "max_tokens": 4}}).encode(),
                    json.dumps({"op": "health"}).encode()]
    assert deployment.control_endpoint.startswith("tcp://")
    targets = [(deployment.control_endpoint, [b"", *orders], zmq.DEALER),  # REP's envelope, several orders at once
               (f"tcp://127.0.0.1:{deployment.ports['relay']}", relay_frames, zmq.DEALER),
               (deployment.endpoint("ingress"), [control.encode(control.SwitchTransport(transport="zmq"))], zmq.REQ),
               (deployment.endpoint("events"), [], zmq.SUB)]
    for endpoint, frames, kind in targets:
        for server_key in (None, deployment.keys.public):
            assert not _stranger(endpoint, frames, kind, server_key), (endpoint, server_key)
    time.sleep(0.5)
    status = deployment.request(deployment.control_endpoint, control.GetStatus(), timeout_s=5)
    assert status.state == "ready"
    ready = httpx.get(f"{deployment.url}/ready", timeout=5).json()
    assert ready["admission_limit"] is None and ready["transport"] == "shm"
    _still_serving(deployment)


def test_a_zero_admission_limit_and_a_drain_say_so_and_can_be_undone(deployment):
    ask = deployment.request
    assert isinstance(ask(deployment.control_endpoint, control.SetLimits(max_running=0)), control.Ack)
    try:
        r = httpx.get(f"{deployment.url}/ready", timeout=5)
        assert r.status_code == 503 and "admission limit is 0" in r.json()["reason"]
    finally:
        ask(deployment.control_endpoint, control.SetLimits(max_running=None))
    assert isinstance(ask(deployment.control_endpoint, control.Drain()), control.Ack)
    try:
        r = httpx.get(f"{deployment.url}/ready", timeout=5)
        assert r.status_code == 503 and r.json()["engine"] == "draining"
    finally:
        assert isinstance(ask(deployment.control_endpoint, control.Resume()), control.Ack)
    _still_serving(deployment)


def test_nothing_listens_beyond_loopback_and_no_ipc_file_is_open_to_others(deployment):
    pids = {deployment.process.pid, *deployment.pids.values()}
    listening = subprocess.run(["ss", "-H", "-ltnp"], capture_output=True, text=True, check=True).stdout
    ours = [line for line in listening.splitlines() if any(f"pid={pid}," in line for pid in pids)]
    ports = {int(p) for p in (*deployment.ports.values(), deployment.url.rsplit(":", 1)[1])}
    assert {int(line.split()[3].rsplit(":", 1)[1]) for line in ours} == ports, ours
    assert all(line.split()[3].startswith("127.0.0.1:") for line in ours), ours

    private = deployment.settings.private_dir
    info = private.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert {p.name for p in private.iterdir()} >= {"ingress", "events", "control.key"}
    assert stat.S_IMODE((private / "control.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(SlotTable.path_for(deployment.deployment).stat().st_mode) == 0o600
    _still_serving(deployment)


def test_the_long_stream_came_through_whole_and_sigterm_leaves_nothing_behind(deployment):
    stream = deployment.stream
    stream.finish.set()
    _wait(lambda: stream.ended_at > 0, 120, "the long stream to end")
    assert stream.error is None and stream.done
    assert not any("error" in e for e in stream.events)
    usage = next(e["usage"] for e in reversed(stream.events) if e.get("usage"))
    assert usage["completion_tokens"] == STREAM_TOKENS
    assert [c["finish_reason"] for e in stream.events for c in e["choices"] if c["finish_reason"]] == ["length"]

    deployment.process.terminate()
    deployment.process.wait(60)
    assert not deployment.settings.private_dir.exists()
    assert not SlotTable.path_for(deployment.deployment).exists()
