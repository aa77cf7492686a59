"""Scheduling policies: in which order a step hands out its token budget, keeps KV pages and picks victims.

- `fcfs`: arrival order.
- `priority`: vLLM's priority scheduling (lower runs first), then arrival.
- `slo` (the default): latency-sensitive before best-effort (QLLM's preemption at step granularity), then
  priority, then TTFT deadline (least slack first), then arrival. Victims for pages are best-effort first,
  lowest priority, then the longest-running; and the step's tokens are capped so that running decodes meet
  their TPOT SLOs by the step-time model the driver keeps.

Every order is a stable lexicographic sort, so it is a few tensor ops with no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blink.engine.core.state import Slots

POLICIES = ("fcfs", "priority", "slo")
MIN_CAPPED_TOKENS = 64  # a TPOT cap never leaves prefills less than this (or the slot count)


def lexsort(keys: list[torch.Tensor], first: torch.Tensor) -> torch.Tensor:
    """Indices sorting by `keys`, the first most significant, with the slots in the mask `first` ahead."""
    order = torch.arange(first.shape[0], device=first.device)
    for key in reversed([(~first).long(), *keys]):
        order = order[key[order].argsort(stable=True)]
    return order


@dataclass(frozen=True)
class Policy:
    name: str = "slo"

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {self.name!r}")

    def keep_keys(self, s: Slots) -> list[torch.Tensor]:
        """Precedence for pages: who keeps them when they run short."""
        if self.name == "fcfs":
            return [s.arrival]
        if self.name == "priority":
            return [s.priority, s.arrival]
        return [s.service_class, s.priority, s.ttft_deadline, s.arrival]

    def budget_keys(self, s: Slots, prefill: torch.Tensor) -> list[torch.Tensor]:
        """Precedence for tokens: decodes before prefill chunks, inside the class for `slo`."""
        keys = self.keep_keys(s)
        at = 1 if self.name == "slo" else 0
        return [*keys[:at], prefill.long(), *keys[at:]]

    def victim_keys(self, s: Slots) -> list[torch.Tensor]:
        """Who gives pages back first."""
        if self.name != "slo":
            return [-k for k in self.keep_keys(s)]
        return [-s.service_class, -s.priority, -(s.seq_len - s.prompt_len), -s.arrival]

    def latency_sensitive(self, s: Slots) -> torch.Tensor:
        if self.name != "slo":
            return torch.zeros_like(s.rotated)
        return s.service_class == 0

    def token_cap(self, s: Slots, decoding: torch.Tensor, cost: torch.Tensor, budget: int) -> torch.Tensor:
        """The most tokens a step may run so that it ends within the tightest TPOT SLO of the sequences decoding
        in it, by the step-time model cost = [seconds per step, seconds per token, ...]."""
        if self.name != "slo":
            return torch.full((), budget, device=cost.device)  # a fill, not a host copy: capturable
        tightest = torch.where(decoding, s.tpot_slo, math.inf).amin()
        tokens = ((tightest - cost[0]) / cost[1]).nan_to_num(nan=budget, posinf=budget).floor()
        floor = min(budget, max(s.num_slots, MIN_CAPPED_TOKENS))
        return tokens.clamp(min=floor, max=budget).long()


class StepCostModel:
    """Host side: fits step seconds = a + b * tokens to the steps the driver timed, forgetting old ones, and
    before each plan writes [a, b, seconds since the previous plan] into the device tensor the step reads (the
    last for the time requests spend waiting): one small copy per step."""

    def __init__(self, cost: torch.Tensor, forget: float = 0.98):
        self.cost, self.forget = cost, forget
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._a = self._b = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        f = self.forget
        self._n, self._x, self._y = f * self._n + 1, f * self._x + tokens, f * self._y + seconds
        self._xx, self._xy = f * self._xx + tokens * tokens, f * self._xy + tokens * seconds
        var = self._n * self._xx - self._x ** 2
        b = (self._n * self._xy - self._x * self._y) / var if var > 1e-9 * max(1.0, self._n * self._xx) else 0.0
        self._b = max(b, 0.0)
        self._a = max(0.0, (self._y - self._b * self._x) / self._n)

    def planning(self, since_last_plan: float) -> None:
        self.cost.copy_(torch.tensor([self._a, self._b, since_last_plan], dtype=self.cost.dtype), non_blocking=True)
