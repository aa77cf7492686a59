"""The slot table between two processes: no torn record, nothing lost or duplicated, one finish each."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import stat
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blink.shared.slot_table import Finish, Geometry, Request, SlotState, SlotTable


def _prompt(request_id: int, length: int) -> list[int]:
    return [(request_id * 7919 + i * 31) % 100_003 for i in range(length)]


def _token(request_id: int, i: int) -> int:
    return (request_id * 104_729 + i * 17) % 1_000_003


def _engine(name: str, total: int, jitter: float, seed: int, errors) -> None:
    """Admits, checks each payload, emits max_tokens tokens through the window, then finishes."""
    rng = random.Random(seed)
    table = SlotTable.attach(name)
    active: dict[int, tuple[int, int, int]] = {}  # slot -> (request id, emitted, max_tokens)
    done = 0
    try:
        while done < total:
            for slot in table.submitted():
                s = table.slots[slot]
                request_id, n = int(s["seed"]), int(s["prompt_len"])
                if s["prompt"][:n].tolist() != _prompt(request_id, n):
                    errors.put(f"torn prompt in slot {slot} for request {request_id}")
                table.admit(slot)
                active[slot] = (request_id, 0, int(s["max_tokens"]))
            for slot, (request_id, emitted, limit) in list(active.items()):
                burst = min(rng.randint(0, 3), table.room(slot), limit - emitted)
                for i in range(emitted, emitted + burst):
                    table.emit(slot, _token(request_id, i), logprob=-float(i))
                emitted += burst
                active[slot] = (request_id, emitted, limit)
                if emitted == limit:
                    table.finish(slot, Finish.LENGTH)
                    del active[slot]
                    done += 1
            table.heartbeat()
            if jitter:
                time.sleep(rng.random() * jitter)
    finally:
        table.close()


def _ingress(table: SlotTable, requests: list[tuple[int, int]], jitter: float, seed: int) -> dict[int, list[int]]:
    """Publishes every request as slots free up and collects what comes back."""
    rng = random.Random(seed)
    pending = list(enumerate(requests))
    owner: dict[int, int] = {}
    received: dict[int, list[int]] = {}
    finishes: dict[int, int] = {}
    deadline = time.monotonic() + 60
    while len(finishes) < len(requests):
        assert time.monotonic() < deadline, "the exchange stalled"
        for slot in range(table.geometry.num_slots):
            if slot not in owner and pending and table.slots[slot]["state"] == SlotState.FREE:
                request_id, (prompt_len, max_tokens) = pending.pop(0)
                table.publish(slot, Request(_prompt(request_id, prompt_len), max_tokens, seed=request_id))
                owner[slot] = request_id
        for slot, request_id in list(owner.items()):
            out = table.read(slot)
            received.setdefault(request_id, []).extend(out.tokens)
            assert out.logprobs == [-float(i) for i in range(len(received[request_id]) - len(out.tokens),
                                                             len(received[request_id]))]
            if out.finish != Finish.NONE:
                finishes[request_id] = finishes.get(request_id, 0) + 1
                table.free(slot)
                del owner[slot]
        if jitter:
            time.sleep(rng.random() * jitter)
    assert all(count == 1 for count in finishes.values())
    return received


def _exchange(geometry: Geometry, requests: list[tuple[int, int]], jitter: float, seed: int) -> None:
    name = f"test-{uuid.uuid4().hex[:12]}"
    table = SlotTable.create(name, geometry)
    errors = mp.get_context("spawn").Queue()
    engine = mp.get_context("spawn").Process(target=_engine, args=(name, len(requests), jitter, seed, errors))
    engine.start()
    try:
        received = _ingress(table, requests, jitter, seed + 1)
        engine.join(30)
        assert engine.exitcode == 0
        assert errors.empty(), errors.get()
        for request_id, (_, max_tokens) in enumerate(requests):
            assert received[request_id] == [_token(request_id, i) for i in range(max_tokens)]
    finally:
        if engine.is_alive():
            engine.kill()
        table.close()
        table.unlink()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_slots=st.integers(1, 6),
    window=st.integers(1, 8),
    requests=st.lists(st.tuples(st.integers(1, 48), st.integers(1, 30)), min_size=1, max_size=24),
    jitter=st.sampled_from([0.0, 0.0005]),
    seed=st.integers(0, 1000),
)
def test_concurrent_ingress_and_engine_lose_and_tear_nothing(num_slots, window, requests, jitter, seed):
    _exchange(Geometry(num_slots=num_slots, max_prompt_tokens=48, window=window), requests, jitter, seed)


def test_segment_is_private_and_attach_checks_it(tmp_path):
    name = f"test-{uuid.uuid4().hex[:12]}"
    table = SlotTable.create(name, Geometry(num_slots=2, max_prompt_tokens=8, window=4))
    try:
        assert stat.S_IMODE(os.stat(table.path).st_mode) == 0o600
        other = SlotTable.attach(name)
        assert other.geometry == table.geometry
        other.close()
        with pytest.raises(FileExistsError):
            SlotTable.create(name, table.geometry)
    finally:
        table.close()
        table.unlink()
    with pytest.raises(FileNotFoundError):
        SlotTable.attach(name)


def test_stale_epoch_slots_are_not_admitted():
    name = f"test-{uuid.uuid4().hex[:12]}"
    table = SlotTable.create(name, Geometry(num_slots=2, max_prompt_tokens=8, window=4), epoch=3)
    try:
        table.publish(0, Request([1, 2], 4))
        table.header["epoch"] = 4  # the engine restarted
        table.publish(1, Request([1, 2], 4))
        assert table.submitted().tolist() == [1]
    finally:
        table.close()
        table.unlink()


def test_the_engine_cannot_overrun_the_window():
    name = f"test-{uuid.uuid4().hex[:12]}"
    table = SlotTable.create(name, Geometry(num_slots=1, max_prompt_tokens=8, window=2))
    try:
        table.publish(0, Request([1], 5))
        table.emit(0, 1)
        table.emit(0, 2)
        assert table.room(0) == 0
        with pytest.raises(RuntimeError, match="full"):
            table.emit(0, 3)
        assert table.read(0).tokens == [1, 2]
        table.emit(0, 3)
        assert table.read(0).tokens == [3]
    finally:
        table.close()
        table.unlink()


def test_the_shared_package_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, blink.shared.slot_table, blink.shared.tokenizer, blink.ingress; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
