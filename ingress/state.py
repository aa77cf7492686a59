"""What the ingress's request handlers share."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from blink.ingress.metrics import Metrics
from blink.ingress.remote_slots import RemoteSlotClient
from blink.ingress.slots import SlotClient
from blink.shared.control import EngineInfo, EngineStatus
from blink.shared.service_class import ClassDefaults
from blink.shared.tokenizer import Tokenizer


@dataclass
class IngressState:
    info: EngineInfo
    tokenizer: Tokenizer
    client: SlotClient | RemoteSlotClient
    metrics: Metrics
    api_key: str | None = None
    engine_status: Callable[[], EngineStatus | None] = lambda: None
    draining: bool = False
    seeds: secrets.SystemRandom = field(default_factory=secrets.SystemRandom)
    classes: ClassDefaults = field(default_factory=ClassDefaults)  # the control plane may replace it

    @property
    def degraded(self) -> bool:
        """Running a fallback: the engine on the CPU (no GPU), or requests relayed over ZeroMQ (no NIC path)."""
        return self.info.device.startswith("cpu") or self.transport == "zmq"

    @property
    def transport(self) -> str:
        return self.client.transport

    @property
    def in_flight(self) -> int:
        """Requests holding or waiting for a slot: what a drain waits for (uvicorn then flushes the responses)."""
        return self.client.running + self.client.waiting
