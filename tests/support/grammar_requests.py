"""The device modes' structured-output tests' requests, and serving them through a slot table until they finish
(tests/engine/test_grammar_device_step.py steps the device itself; test_grammar_device_gpu.py lets a driver run)."""

from __future__ import annotations

import time
from collections.abc import Callable

from blink.shared.grammar import GrammarSpec
from blink.shared.slot_table import Finish, Request, SlotTable

PROMPT = [5, 6, 7, 8]
REGEX = r"[a-c]{3,6}"
CHOICES = ["cat", "dog", "a bird"]
PLAIN = Request(prompt=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)


def constrained(spec: GrammarSpec, **sampling) -> Request:
    return Request(prompt=PROMPT, max_tokens=60, grammar_kind=int(spec.kind), grammar=spec.text, **sampling)


def serve(table: SlotTable, requests: dict[int, Request], between: Callable[[], None], seconds: float,
          publish: bool = True) -> dict[int, tuple[list[int], Finish]]:
    """Publishes `requests` (unless they were), then calls `between` and reads each slot until every one finished;
    each slot's tokens and finish. The slots are freed."""
    for slot, request in requests.items() if publish else ():
        table.publish(slot, request)
    got = {slot: ([], Finish.NONE) for slot in requests}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        between()
        for slot in requests:
            out = table.read(slot)
            got[slot] = (got[slot][0] + out.tokens, out.finish or got[slot][1])
        if all(finish for _, finish in got.values()):
            for slot in requests:
                table.free(slot)
            return got
    raise AssertionError(f"not finished after {seconds} s: {got}")
