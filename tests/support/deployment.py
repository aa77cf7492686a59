"""A running deployment as the fault tests watch it (tests/serving/test_watchdog.py, test_transports.py,
test_tensor_parallel.py): streams and their terminal events, waits, the engine's pid, the slot table's states."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from blink.shared import control
from blink.shared.slot_table import SlotState, SlotTable

MODEL = "blink-tiny-llama-v1"
DEADLINE_S = 2.0
SLACK_S = 1.5  # the watchdog's tick, the ingress's poll, the client's read


@dataclass
class StreamResult:
    tokens: int = 0  # the usage chunk's count: a lagging reader gets several tokens in one chunk
    finish_reasons: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    ended_at: float = 0.0

    @property
    def terminal_events(self) -> int:
        return len(self.finish_reasons) + len(self.errors)


def stream(url: str, prompt: str | list[int], max_tokens: int) -> StreamResult:
    result = StreamResult()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:  # failed before its first token: the error is the whole answer
            assert response.status_code == 503, response.read()
            result.errors.append(json.loads(response.read())["error"])
            result.done, result.ended_at = True, time.monotonic()
            return result
        for line in response.iter_lines():
            if line == "data: [DONE]":
                result.done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    result.errors.append(event["error"])
                elif event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                elif finish := event["choices"][0]["finish_reason"]:
                    result.finish_reasons.append(finish)
    result.ended_at = time.monotonic()
    return result


def engine_pid(server) -> int:
    info = server.request(server.control_endpoint, control.Hello(), timeout_s=5)
    assert isinstance(info, control.EngineInfo)
    return info.pid


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_ready_and_serving(server, timeout_s: float = 90) -> None:
    def ready() -> bool:
        try:
            return httpx.get(f"{server.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout_s, "/ready")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}  # sampled: EOS could come first
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def decoding(table: SlotTable, n: int):
    """Whether n slots are admitted and have produced a few tokens (a freed slot keeps its old counts)."""
    states, produced = table.slots["state"], table.slots["produced"]
    return lambda *_: ((states == SlotState.ADMITTED) & (produced >= 3)).sum() == n


def gone(pid: int) -> bool:
    """Exited; a zombie counts, since whoever reaps orphans here is not this test's business."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def table_empty(table: SlotTable) -> bool:
    return bool((table.slots["state"] == SlotState.FREE).all())
