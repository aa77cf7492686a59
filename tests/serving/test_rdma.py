"""The rdma transport. Everything that is not a verbs call runs here through shared memory: the replica table's
byte layout and publish ordering, requests end to end against a real engine, the loss of the path and its
restoration, the watchdog's switch to zmq, the fallback when rdma cannot start, `blink doctor`. The verbs path
itself runs where ibv_devices lists a device (marked `rdma`)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest
import zmq

from blink.bench.lib.server import running_server
from blink.engine import Engine, EngineConfig
from blink.engine.drive.host import HostDriver
from blink.ingress.slots import SlotClient
from blink.shared import control, sockets
from blink.shared.remote_memory import MappedMemory, TransportLost
from blink.shared.replica_table import ReplicaTable
from blink.shared.slot_table import HEADER_BYTES, Finish, Geometry, Request, SlotState, SlotTable


class RecordingMemory(MappedMemory):
    """MappedMemory that also keeps the order of the regions written (the copies are the real ones)."""

    def __init__(self, path):
        super().__init__(path)
        self.writes: list[list[tuple[int, int]]] = []

    def write(self, regions):
        self.writes.append(list(regions))
        super().write(regions)


@pytest.fixture
def table():
    t = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(4, 64, 8))
    yield t
    t.close()
    t.unlink()


def test_publish_writes_the_payload_then_the_state_word(table):
    memory = RecordingMemory(table.path)
    replica = ReplicaTable(memory, table.geometry)
    replica.publish(2, Request(list(range(1, 40)), 5, seed=7, stop_token_ids=(3,), service_class=1))
    (payload, state), = memory.writes
    record = table.slots.dtype
    state_offset = HEADER_BYTES + 2 * record.itemsize + record.fields["state"][1]
    assert state == (state_offset, 4)
    assert not payload[0] <= state_offset < payload[0] + payload[1]  # the state word is not in the payload
    s = table.slots[2]
    assert int(s["state"]) == SlotState.SUBMITTED and s["prompt"][:39].tolist() == list(range(1, 40))
    assert int(s["seed"]) == 7 and int(s["service_class"]) == 1 and s["stop_ids"][:1].tolist() == [3]


def test_a_replica_reads_only_what_the_engine_published(table):
    replica = ReplicaTable(MappedMemory(table.path), table.geometry)
    replica.publish(0, Request([1, 2], 4))
    table.admit(0)
    table.emit(0, 11)
    table.emit(0, 12)
    replica.refresh([0])
    assert replica.read(0).tokens == [11, 12]
    assert int(table.slots[0]["consumed"]) == 2  # pushed back: the engine may reuse those cells
    table.emit(0, 13)
    table.finish(0, Finish.LENGTH)
    replica.refresh([0])
    out = replica.read(0)
    assert out.tokens == [13] and out.finish == Finish.LENGTH
    replica.free(0)
    assert int(table.slots[0]["state"]) == SlotState.FREE


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine(EngineConfig(model=str(checkpoint("qwen3")), max_num_seqs=4, max_num_batched_tokens=64,
                               num_pages=64, page_size=8, max_model_len=128))


def _drive(engine, table, stop: threading.Event) -> threading.Thread:
    driver = HostDriver(engine, table)

    def loop():
        while not stop.is_set():
            if not driver.step():
                time.sleep(0.001)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


async def _generate(client: SlotClient, prompts: list[list[int]]) -> list[list[int]]:
    async def one(prompt):
        stream = await client.submit(Request(prompt, 12, temperature=0.0, ignore_eos=True))
        return [t async for out in client.outputs(stream) for t in out.tokens]

    return await asyncio.gather(*(one(p) for p in prompts))


def test_requests_through_a_replica_equal_those_through_shm(engine):
    prompts = [[5, 6, 7, 8], list(range(10, 60)), [99] * 7, [1, 2, 3], [42, 43]]
    results = {}
    for name in ("shm", "replica"):
        table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", engine.geometry(4, 128))
        stop = threading.Event()
        thread = _drive(engine, table, stop)
        view = table if name == "shm" else ReplicaTable(MappedMemory(table.path), table.geometry)

        async def run(view=view):
            client = SlotClient(view, max_waiting=8)
            client.start()
            try:
                return await asyncio.wait_for(_generate(client, prompts), 60)
            finally:
                await client.stop()

        try:
            results[name] = asyncio.run(run())
        finally:
            stop.set()
            thread.join()
            table.close()
            table.unlink()
    assert results["replica"] == results["shm"]
    assert all(len(tokens) == 12 for tokens in results["shm"])


def test_a_lost_path_is_restored_and_the_request_completes_once(engine):
    table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", engine.geometry(4, 128))
    stop = threading.Event()
    thread = _drive(engine, table, stop)
    replica = ReplicaTable(MappedMemory(table.path), table.geometry)
    attempts: list[str | None] = []
    clients: list[SlotClient] = []

    def relink():
        attempts.append(clients[0].transport_lost)  # what /ready and the watchdog's pings see meanwhile
        if len(attempts) < 3:
            raise TransportLost("the NIC is still down")
        replica.rebind(MappedMemory(table.path))

    async def run():
        client = SlotClient(replica, max_waiting=4, relink=relink)
        clients.append(client)
        client.start()
        try:
            stream = await client.submit(Request([3, 4, 5], 40, temperature=0.0, ignore_eos=True))
            tokens = []
            async for out in client.outputs(stream):
                tokens += out.tokens
                if len(tokens) >= 5 and not attempts:
                    replica.remote.close()  # the path goes away mid-stream
            return tokens, out.finish, client.transport_lost
        finally:
            await client.stop()

    try:
        tokens, finish, lost_after = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        stop.set()
        thread.join()
    assert len(attempts) == 3 and all("closed" in why or "down" in why for why in attempts) and lost_after is None
    assert finish == Finish.LENGTH and len(tokens) == 40  # every token once: none lost, none repeated
    expected = table_free_run(engine, [3, 4, 5])
    table.close()
    table.unlink()
    assert tokens == expected


def table_free_run(engine, prompt: list[int]) -> list[int]:
    from blink.engine.drive.offline import OfflineDriver
    from blink.engine.sampling_params import SamplingParams

    driver = OfflineDriver(engine)
    driver.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), 40)
    tokens = []
    while driver.has_work():
        tokens += [e.token for e in driver.step() if e.token is not None]
    return tokens


def test_the_watchdog_moves_an_ingress_whose_path_stays_lost_to_zmq(tmp_path):
    from blink.services.watchdog import ProcessSupervisor, Watchdog
    from blink.shared.settings import Settings

    settings = Settings(deployment=f"t{uuid.uuid4().hex[:8]}", runtime_dir=str(tmp_path), watchdog_deadline=0.5)
    keys = sockets.load_keys(settings, create=True)
    ingress = zmq.Context.instance().socket(zmq.REP)
    sockets.bind(ingress, settings.ingress_control_endpoint, keys)
    events = zmq.Context.instance().socket(zmq.SUB)
    sockets.connect(events, settings.events_endpoint, keys)
    events.setsockopt(zmq.SUBSCRIBE, b"")
    got: list = []

    def answer():
        if ingress.poll(2000):
            got.append(control.decode(ingress.recv()))
            ingress.send(control.encode(control.Ack()))

    watchdog = Watchdog(settings, ProcessSupervisor(settings), now=0.0)
    time.sleep(0.3)  # the subscription reaches the watchdog's PUB socket
    try:
        lost = control.IngressStatus(pid=1, running=3, waiting=0, failovers=0, draining=False, transport="rdma",
                                     transport_lost="RDMA completion error: retry exceeded")
        watchdog._watch_transport(lost, now=10.0)
        watchdog._watch_transport(lost, now=10.4)
        assert not got  # still within the deadline: the ingress may yet restore it
        replier = threading.Thread(target=answer)
        replier.start()
        watchdog._watch_transport(lost, now=10.6)
        replier.join()
        assert got == [control.SwitchTransport(transport="zmq")]
        seen = []
        while events.poll(500):
            seen.append(json.loads(events.recv())["event"])
        assert seen[-2:] == ["transport_lost", "transport_switched"]
    finally:
        watchdog.close()
        ingress.close()
        events.close()


def test_serve_with_rdma_falls_back_to_zmq_when_rdma_cannot_start(tmp_path):
    with running_server(tmp_path, "--transport", "rdma") as server:
        ready = httpx.get(f"{server.url}/ready").json()
        assert ready["transport"] == "zmq" and ready["degraded"] is True
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "blink-tiny-llama-v1", "prompt": "Hi",
                                                              "max_tokens": 3, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_doctor_names_each_transport_and_drive_mode_and_why():
    out = subprocess.run([sys.executable, "-m", "blink.services.cli", "doctor", "--json"], capture_output=True,
                         text=True, check=True)
    found = {(c["kind"], c["name"]): c for c in json.loads(out.stdout)}
    for key in (("transport", "shm"), ("transport", "rdma"), ("transport", "zmq"), ("drive", "host"),
                ("drive", "graph"), ("drive", "persistent"), ("feature", "huge-pages"), ("model", "checkpoint"),
                ("model", "gguf"), ("model", "hub"), ("model", "default")):
        assert key in found and found[key]["why"]
    assert found[("transport", "zmq")]["available"] and found[("drive", "host")]["available"]
    from tests.conftest import _rdma_missing

    assert found[("transport", "rdma")]["available"] == (_rdma_missing() is None)


@pytest.mark.rdma
def test_serve_over_a_loopback_queue_pair_and_reconnect_after_an_engine_restart(tmp_path):
    import os
    import signal

    with running_server(tmp_path, "--transport", "rdma") as server:
        assert httpx.get(f"{server.url}/ready").json()["transport"] == "rdma"
        body = {"model": "blink-tiny-llama-v1", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["usage"][
            "completion_tokens"] == 8
        info = server.request(server.control_endpoint, control.Hello(), timeout_s=2)
        os.kill(info.pid, signal.SIGKILL)  # the watchdog restarts it in a new epoch
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready = httpx.get(f"{server.url}/ready").json()
            if ready["ready"] and ready["epoch"] > info.epoch:
                break
            time.sleep(0.5)
        assert ready["transport"] == "rdma"  # reconnected, not degraded
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200


def test_restoring_the_path_hands_free_slots_to_waiters_and_keeps_the_reserve(table):
    """A best-effort waiter held back by the latency-sensitive reserve stays waiting after a restore (which must
    return, not spin on the reserved slot), and a latency-sensitive waiter gets that slot."""
    replica = ReplicaTable(MappedMemory(table.path), table.geometry)

    def relink():
        replica.rebind(MappedMemory(table.path))

    async def run():
        client = SlotClient(replica, max_waiting=4, reserved_slots=1, relink=relink)
        client.start()
        try:
            for _ in range(3):
                await client.submit(Request([1], 4, service_class=1))  # three of four slots
            held = asyncio.ensure_future(client.submit(Request([1], 4, service_class=1)))
            await asyncio.sleep(0.05)
            replica.remote.close()  # lost: the poller restores it
            await asyncio.sleep(0.3)
            assert client.transport_lost is None and not held.done()
            urgent = await asyncio.wait_for(client.submit(Request([1], 4, service_class=0)), 2)
            assert table.slots[urgent.slot]["state"] == SlotState.SUBMITTED
            held.cancel()
        finally:
            await client.stop()

    asyncio.run(asyncio.wait_for(run(), 20))


def test_the_engine_closes_queue_pairs_ingresses_left_behind(monkeypatch):
    """An ingress whose path broke handshakes again with a new queue pair: the engine's side closes the pairs in
    the error state and, past MAX_PAIRS, the oldest, rather than keeping one per handshake. (The bookkeeping, with
    the verbs calls stood in for; the pairs themselves run where a device is.)"""
    from blink.shared import rdma

    class Pair:
        def __init__(self, port):
            self.broken = self.closed = False

        def connect(self, remote):
            pass

        def peer(self):
            return None

        def in_error(self):
            return self.broken

        def close(self):
            self.closed = True

    monkeypatch.setattr(rdma, "QueuePair", Pair)
    target = object.__new__(rdma.TableTarget)
    target.port, target.pairs, target.mr = None, [], type("MR", (), {"buf": 0, "rkey": 0})()
    for _ in range(3):
        target.accept(None)
    first, second, third = target.pairs
    second.broken = True
    target.accept(None)
    assert second.closed and not first.closed and target.pairs[:2] == [first, third] and len(target.pairs) == 3
    for _ in range(2 * rdma.MAX_PAIRS):
        target.accept(None)
    assert len(target.pairs) == rdma.MAX_PAIRS and first.closed and third.closed
