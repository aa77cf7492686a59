"""The `zmq` transport (degraded: the ingress cannot map the slot table, so the engine host's relay publishes
for it): forced by flag, chosen by itself when the table is not on the ingress's host, the same outputs as the
offline engine, cancellation, and engine failover through the relay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest

from blink.bench.lib.server import free_port, running_server
from blink.engine import LLM, SamplingParams
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared import control
from blink.shared.slot_table import SlotTable
from tests.support.deployment import MODEL, engine_pid, stream, wait_ready_and_serving, wait_until

pytestmark = pytest.mark.slow  # whole deployments (blink serve): CI runs them; `-m "not slow"` skips them

PROMPTS = ["Once upon a time", "The engine admits", "Hello, my name is"]


@pytest.fixture(scope="module")
def zmq_server(tmp_path_factory):
    ensure_tiny_model()
    with running_server(tmp_path_factory.mktemp("zmq"), "--transport", "zmq", "--watchdog-deadline", "2") as s:
        yield s


def test_forced_zmq_serves_what_the_engine_computes(zmq_server):
    ready = httpx.get(f"{zmq_server.url}/ready").json()
    assert (ready["transport"], ready["degraded"]) == ("zmq", True)
    metrics = httpx.get(f"{zmq_server.url}/metrics").text
    assert 'transport="zmq"' in metrics and "blink:degraded{" in metrics and "} 1.0" in metrics
    client = openai.OpenAI(base_url=f"{zmq_server.url}/v1", api_key="unused")
    got = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
           for p in PROMPTS]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True))
    two = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, n=2)
    llm = LLM(str(ensure_tiny_model()), max_num_seqs=4)
    expected = [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    assert got == expected and streamed == expected[0]
    assert [c.text for c in two.choices] == [expected[1]] * 2


def test_a_client_that_leaves_frees_its_slot_through_the_relay(zmq_server):
    body = {"model": MODEL, "prompt": "leave early", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{zmq_server.url}/v1/completions", json=body, timeout=0.5)
    wait_until(lambda: zmq_server.request(zmq_server.control_endpoint, control.GetStatus()).running == 0, 3,
               "the engine to drop the abandoned request")


def test_engine_failover_reaches_zmq_clients(zmq_server):
    wait_ready_and_serving(zmq_server)
    pid = engine_pid(zmq_server)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, zmq_server.url, "decode a while", 1500) for _ in range(4)]
        wait_until(lambda: zmq_server.request(zmq_server.control_endpoint, control.GetStatus()).running == 4, 30,
                   "4 running requests")
        time.sleep(0.3)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = [f.result(timeout=30) for f in futures]
    for r in results:
        assert r.done and r.terminal_events == 1 and r.errors[0]["code"] == "engine_failure"
        assert r.ended_at - killed_at < 4.0
    wait_ready_and_serving(zmq_server)


def test_auto_picks_zmq_when_the_table_is_not_on_this_host(tmp_path):
    """A separate shared-memory directory stands for another host: the ingress cannot map the table."""
    deployment, port = f"test-{uuid.uuid4().hex[:10]}", free_port()
    flags = ["--deployment", deployment, "--runtime-dir", str(tmp_path), "--port", str(port)]
    elsewhere = tmp_path / "other-host-shm"
    elsewhere.mkdir()
    log = open(tmp_path / "services.log", "w")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "blink.services.cli"]
    engine = subprocess.Popen([*cmd, "engine", *flags], stdout=log, stderr=subprocess.STDOUT)
    ingress = subprocess.Popen([*cmd, "ingress", *flags], stdout=log, stderr=subprocess.STDOUT,
                               env=os.environ | {"BLINK_SHM_DIR": str(elsewhere)})
    try:
        server = type("Deployment", (), {"url": f"http://127.0.0.1:{port}"})
        wait_ready_and_serving(server)
        assert httpx.get(f"{server.url}/ready").json()["transport"] == "zmq"
    finally:
        for proc in (ingress, engine):
            proc.terminate()
            proc.wait(30)
        log.close()
    assert not SlotTable.path_for(deployment).exists()  # the engine's relay held the table: nobody else maps it


def test_switching_to_zmq_mid_run_loses_nothing(tmp_path):
    """What the watchdog does when a NIC path is lost: requests in flight move to the relay and finish with
    exactly the tokens they would have had; new ones go through the relay."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.deployment import decoding, table_empty

    prompts = [f"switch number {i}" for i in range(8)]
    expected = [o.text for o in LLM(str(ensure_tiny_model()), max_num_seqs=8).generate(
        prompts, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))]

    def streamed(url: str, prompt: str) -> tuple[str, list]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=200, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True))
        return "".join(c.choices[0].text for c in chunks), [c.choices[0].finish_reason for c in chunks]

    with running_server(tmp_path, "--max-num-seqs", "8") as server:
        table = SlotTable.attach(server.deployment)
        try:
            assert httpx.get(f"{server.url}/ready").json()["transport"] == "shm"
            with ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(streamed, server.url, p) for p in prompts]
                wait_until(decoding(table, 8), 60, "8 decoding requests")
                reply = server.request(server.endpoint("ingress"), control.SwitchTransport(transport="zmq"),
                                        timeout_s=10)
                assert isinstance(reply, control.Ack), reply
                results = [f.result(timeout=120) for f in futures]
            for (text, finishes), want in zip(results, expected, strict=True):
                assert text == want and [f for f in finishes if f] == ["length"]
            ready = httpx.get(f"{server.url}/ready").json()
            assert (ready["transport"], ready["degraded"]) == ("zmq", True)
            assert 'transport="zmq"' in httpx.get(f"{server.url}/metrics").text
            assert streamed(server.url, prompts[0])[0] == expected[0]  # through the relay now
            wait_until(lambda: table_empty(table), 10, "every slot to be free")
        finally:
            table.close()


def test_an_unreachable_relay_is_a_503_not_a_hang(tmp_path):
    """An ingress forced to zmq beside an engine that runs no relay (--transport shm)."""
    deployment, port = f"test-{uuid.uuid4().hex[:10]}", free_port()
    flags = ["--deployment", deployment, "--runtime-dir", str(tmp_path), "--port", str(port)]
    log = open(tmp_path / "services.log", "w")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "blink.services.cli"]
    engine = subprocess.Popen([*cmd, "engine", *flags, "--transport", "shm"], stdout=log, stderr=subprocess.STDOUT)
    ingress = subprocess.Popen([*cmd, "ingress", *flags, "--transport", "zmq"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def answering() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(answering, 90, "the ingress")
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and ready.json()["engine"] == "unreachable"
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unreachable"
    finally:
        for proc in (ingress, engine):
            proc.terminate()
            proc.wait(30)
        log.close()


def test_a_relay_whose_table_has_another_publisher_answers_503(tmp_path):
    """A second ingress over zmq beside a deployment whose shm ingress feeds the table: the relay cannot claim it,
    and the client hears why in OpenAI's envelope (it was a 500)."""
    ensure_tiny_model()
    with running_server(tmp_path, "--watchdog-deadline", "2") as server:
        assert httpx.get(f"{server.url}/ready").json()["transport"] == "shm"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        port = free_port()
        flags = ["--deployment", server.settings.deployment, "--runtime-dir", str(tmp_path), "--port", str(port)]
        with open(tmp_path / "second-ingress.log", "w") as log:
            ingress = subprocess.Popen([sys.executable, "-m", "blink.services.cli", "ingress", *flags,
                                        "--transport", "zmq"], stdout=log, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_until(lambda: _answers(f"{url}/ready"), 90, "the second ingress")
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "relay_refused" and "shm" in r.json()["error"]["message"]
            finally:
                ingress.terminate()
                ingress.wait(30)
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
