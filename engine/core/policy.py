"""Scheduling policies: in which order a step hands out its token budget, keeps KV pages and picks victims.

- `fcfs`: arrival order.
- `priority`: vLLM's priority scheduling (lower runs first), then arrival.
- `slo` (the default): latency-sensitive before best-effort (QLLM's preemption at step granularity), then
  priority, then TTFT deadline (least slack first), then arrival. Victims for pages are best-effort first,
  lowest priority, then the longest-running; and the step's tokens are capped so that running decodes meet
  their TPOT SLOs by the step-time model the driver keeps.

Every order is a stable lexicographic sort, so it is a few tensor ops with no host sync. Keys of a known width
(`Key`: a class, a priority, a flag) are packed into one integer with their neighbours and sorted once: a sort is
three ops, and a kernel or more each on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blink.engine.core.state import Slots
from blink.shared.request_schema import BY_NAME
from blink.shared.settings import SCHEDULING_POLICIES

POLICIES = SCHEDULING_POLICIES
PRIORITY = BY_NAME["priority"]
PRIORITY_BITS = (int(PRIORITY.lt - PRIORITY.ge) - 1).bit_length()  # a priority's width as a sort key
MIN_CAPPED_TOKENS = 64  # a TPOT cap never leaves prefills less than this (or the slot count)


@dataclass(frozen=True)
class Key:
    """A sort key of int64 values in [0, 2**bits) (the request fields' limits and the context limit bound them)."""

    value: torch.Tensor
    bits: int

    def descending(self) -> Key:
        return Key((1 << self.bits) - 1 - self.value, self.bits)


PACKED_BITS = 63  # what one int64 key holds, its sign left clear


def lexsort(keys: list[torch.Tensor | Key], first: torch.Tensor) -> torch.Tensor:
    """Indices sorting by `keys`, the first most significant, with the slots in the mask `first` ahead. Neighbouring
    `Key`s (and `first`) sort as one: packed into one int64, most significant bits first."""
    sorts: list[torch.Tensor] = []
    packed, width = None, 0
    for key in [Key((~first).long(), 1), *keys]:
        if packed is not None and (not isinstance(key, Key) or width + key.bits > PACKED_BITS):
            sorts.append(packed)
            packed, width = None, 0
        if not isinstance(key, Key):
            sorts.append(key)
            continue
        packed = key.value if packed is None else (packed << key.bits) | key.value
        width += key.bits
    if packed is not None:
        sorts.append(packed)
    *more, least = sorts
    order = least.argsort(stable=True)  # the first pass sorts the key as it is: no arange, no gather
    for key in reversed(more):
        order = order[key[order].argsort(stable=True)]
    return order


def ahead(order: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """`order` with the slots in the mask `first` ahead, each group in its order: lexsort's `first`, for an order
    already sorted (one sort, not one per key)."""
    return order[(~first[order]).long().argsort(stable=True)]


class Policy:
    """What every policy answers; the base's answers are the plain ones (no classes, no SLOs), which `slo`
    overrides. A policy keeps no state: one per engine, made by `policy_named`."""

    name: str

    def keep_keys(self, s: Slots) -> list[torch.Tensor | Key]:
        """Precedence for pages: who keeps them when they run short."""
        raise NotImplementedError

    def budget_keys(self, s: Slots, prefill: torch.Tensor) -> list[torch.Tensor | Key]:
        """Precedence for tokens: decodes before prefill chunks."""
        return [Key(prefill.long(), 1), *self.keep_keys(s)]

    def victim_keys(self, s: Slots) -> list[torch.Tensor | Key]:
        """Who gives pages back first: the keepers' order reversed."""
        return [k.descending() if isinstance(k, Key) else -k for k in self.keep_keys(s)]

    def latency_sensitive(self, s: Slots) -> torch.Tensor:
        """The slots whose class outranks the rest (none here)."""
        return torch.zeros_like(s.rotated)

    def token_cap(self, s: Slots, decoding: torch.Tensor, cost: StepCost, budget: int) -> torch.Tensor:
        """The most tokens a step may run (the whole budget here)."""
        return torch.full((), budget, device=cost.values.device)  # a fill, not a host copy: capturable


class Fcfs(Policy):
    name = "fcfs"

    def keep_keys(self, s: Slots) -> list[torch.Tensor | Key]:
        return [s.arrival]


class Priority(Policy):
    name = "priority"

    def keep_keys(self, s: Slots) -> list[torch.Tensor | Key]:
        return [_priority(s), s.arrival]


class Slo(Policy):
    name = "slo"

    def keep_keys(self, s: Slots) -> list[torch.Tensor | Key]:
        return [Key(s.service_class, 1), _priority(s), s.ttft_deadline, s.arrival]

    def budget_keys(self, s: Slots, prefill: torch.Tensor) -> list[torch.Tensor | Key]:
        """Decodes before prefill chunks inside each class: a latency-sensitive prefill still goes first."""
        cls, *rest = self.keep_keys(s)
        return [cls, Key(prefill.long(), 1), *rest]

    def victim_keys(self, s: Slots) -> list[torch.Tensor | Key]:
        generated = Key(s.seq_len - s.prompt_len, 32)  # below the context limit
        return [Key(s.service_class, 1).descending(), _priority(s).descending(), generated.descending(), -s.arrival]

    def latency_sensitive(self, s: Slots) -> torch.Tensor:
        return s.service_class == 0

    def token_cap(self, s: Slots, decoding: torch.Tensor, cost: StepCost, budget: int) -> torch.Tensor:
        """Within the tightest TPOT SLO of the sequences decoding in the step, by the step-time model."""
        tightest = torch.where(decoding, s.tpot_slo, math.inf).amin()
        tokens = ((tightest - cost.per_step) / cost.per_token).nan_to_num(nan=budget, posinf=budget).floor()
        floor = min(budget, max(s.num_slots, MIN_CAPPED_TOKENS))
        return tokens.clamp(min=floor, max=budget).long()


_BY_NAME: dict[str, type[Policy]] = {p.name: p for p in (Fcfs, Priority, Slo)}
assert tuple(_BY_NAME) == POLICIES, "a policy named in the settings has no class here, or the reverse"


def policy_named(name: str) -> Policy:
    if name not in _BY_NAME:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return _BY_NAME[name]()


def _priority(s: Slots) -> Key:
    """Priorities lie in [low, -low) (the request field's limits): offset to start at 0."""
    return Key(s.priority - PRIORITY.ge, PRIORITY_BITS)


class StepCost:
    """What the step-time model tells the plan, on the engine's device (read there, never by the host): step seconds
    = per_step + per_token * tokens (StepCostModel fits them), and the seconds since the previous plan (what the
    requests left out of it waited). One float64 tensor underneath: tensor-parallel ranks share it in one collective."""

    def __init__(self, device: torch.device):
        self.values = torch.zeros(3, dtype=torch.float64, device=device)

    @property
    def per_step(self) -> torch.Tensor:
        return self.values[0]

    @property
    def per_token(self) -> torch.Tensor:
        return self.values[1]

    @property
    def fit(self) -> torch.Tensor:
        """[per_step, per_token]."""
        return self.values[:2]

    @property
    def since_last_plan(self) -> torch.Tensor:
        return self.values[2]


class StepCostModel:
    """Fits step seconds = a + b * tokens to timed steps, forgetting old ones, and writes [a, b] into `cost.fit`,
    which the TPOT cap reads. Tensor ops on the sums' device with no host read, so the host loop (which times each
    step on the host clock) and the device step (which times itself from the clock it reads, in the graph and
    persistent modes) keep the same fit."""

    def __init__(self, cost: StepCost, forget: float = 0.98):
        self.cost, self.forget = cost, forget
        self.sums = torch.zeros(5, dtype=torch.float64, device=cost.values.device)  # n, Σx, Σy, Σx², Σxy

    def observe(self, tokens: torch.Tensor | int, seconds: torch.Tensor | float,
                valid: torch.Tensor | bool = True) -> None:
        """One step that computed `tokens` in `seconds` (tensors on the sums' device, or numbers), if `valid`."""
        x = torch.as_tensor(tokens, dtype=torch.float64, device=self.sums.device).reshape(())
        y = torch.as_tensor(seconds, dtype=torch.float64, device=self.sums.device).reshape(())
        seen = self.forget * self.sums + torch.stack([torch.ones_like(x), x, y, x * x, x * y])
        self.sums.copy_(torch.where(torch.as_tensor(valid, device=self.sums.device), seen, self.sums))
        n, sx, sy, sxx, sxy = self.sums.unbind()
        var = n * sxx - sx * sx
        b = torch.where(var > 1e-9 * (n * sxx).clamp(min=1.0), (n * sxy - sx * sy) / var.clamp(min=1e-300), 0.0)
        b = b.clamp(min=0.0)
        a = torch.where(n > 0, (sy - b * sx) / n.clamp(min=1e-300), 0.0).clamp(min=0.0)
        self.cost.fit.copy_(torch.stack([a, b]), non_blocking=True)

    def observe_since(self, now: torch.Tensor, last_now: torch.Tensor, last_tokens: torch.Tensor,
                      nap_over: float) -> None:
        """The device step's timing, by the clock it reads: the seconds since the previous step (`now` less
        `last_now`, [1] float64 each; none before the first) are what that step took, `last_tokens` (0-d int64) of
        them, and what each resident request not scheduled waited. The fit learns from it unless that step computed
        nothing or a nap came after it (longer than `nap_over` times the prediction). The torch reference of
        blink.engine.kernels.step_cost, which the device step launches."""
        cost = self.cost
        took = torch.where(last_now > 0, now - last_now, 0.0)[0]
        cost.since_last_plan.copy_(took)
        nap = (self.sums[0] >= 3) & (took > nap_over * (cost.per_step + cost.per_token * last_tokens))
        self.observe(last_tokens, took, (last_tokens > 0) & (took > 0) & ~nap)
        last_now.copy_(now)

    def planning(self, since_last_plan: float) -> None:
        """Host side: the seconds since the previous plan, for the time resident requests spent waiting."""
        self.cost.since_last_plan.fill_(since_last_plan)


class HostStepCostModel(StepCostModel):
    """The host loop's fit, from steps it timed on its own clock: StepCostModel's arithmetic on Python floats (float64,
    in the same order, so the same fit), then one copy of [a, b] to the device: its ~25 tensor ops a step were about
    60 us of dispatch on a CPU, where a small model's step is a few milliseconds."""

    def __init__(self, cost: StepCost, forget: float = 0.98):
        self.cost, self.forget = cost, forget
        self.sums = [0.0] * 5  # n, Σx, Σy, Σx², Σxy

    def observe(self, tokens: int, seconds: float, valid: bool = True) -> None:
        if not valid:
            return
        x, y = float(tokens), float(seconds)
        n, sx, sy, sxx, sxy = self.sums = [self.forget * s + v for s, v in zip(self.sums, (1.0, x, y, x * x, x * y),
                                                                                strict=True)]
        var = n * sxx - sx * sx
        b = max((n * sxy - sx * sy) / max(var, 1e-300) if var > 1e-9 * max(n * sxx, 1.0) else 0.0, 0.0)
        a = max((sy - b * sx) / max(n, 1e-300), 0.0) if n > 0 else 0.0
        self.cost.fit.copy_(torch.tensor([a, b], dtype=torch.float64), non_blocking=True)
