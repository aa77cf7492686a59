"""A random churn through the offline driver: requests arrive a few at a time, some are cancelled, and a check runs
after every step; then every request ended once, uncancelled ones with the tokens expected, cancelled ones with a
prefix of them. Shared by the memory-pressure tests (tests/engine/test_scheduler_random.py,
tests/engine/test_prefix_cache.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from blink.engine import SamplingParams


@dataclass
class Churned:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finishes: dict[str, list[str]] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    cached_tokens: int = 0  # prompt tokens the prefix cache gave the requests that finished


def churn(driver, prompts: list[list[int]], params: list[SamplingParams], rng: random.Random,
          after_step: Callable[[], None]) -> Churned:
    """Runs `prompts` through `driver` (a blink.engine.drive.offline.OfflineDriver), `after_step` after each step."""
    out = Churned()
    pending = list(range(len(prompts)))
    while pending or driver.has_work():
        for i in [pending.pop(0) for _ in range(min(len(pending), rng.randint(0, 3)))]:
            driver.add_request(str(i), prompts[i], params[i], params[i].max_tokens)
        if rng.random() < 0.1 and out.tokens:
            victim = rng.choice(sorted(out.tokens))
            if victim not in out.finishes:
                out.cancelled.add(victim)
                for e in driver.abort(victim):
                    out.finishes.setdefault(e.request_id, []).append(e.finish_reason)
        for e in driver.step():
            out.tokens.setdefault(e.request_id, []).extend([e.token] if e.token is not None else [])
            if e.finish_reason:
                out.finishes.setdefault(e.request_id, []).append(e.finish_reason)
                out.cached_tokens += e.stats.cached_tokens if e.stats else 0
        after_step()
    return out


def assert_ended_as(churned: Churned, expected: dict[str, list[int]]) -> None:
    assert sorted(churned.finishes) == sorted(expected) and all(len(f) == 1 for f in churned.finishes.values())
    for rid, want in expected.items():
        got = churned.tokens.get(rid, [])
        assert got == want if rid not in churned.cancelled else got == want[: len(got)]
