"""What the ingress's request handlers share."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from blink.ingress.client import IngressClient
from blink.ingress.cors import CorsPolicy
from blink.ingress.generation_config import SamplingDefaults
from blink.ingress.metrics import Metrics
from blink.ingress.reasoning import ReasoningParser
from blink.ingress.tools import ToolParser
from blink.shared import transports
from blink.shared.control import EngineInfo, EngineStatus
from blink.shared.grammar import COMPILE_TIMEOUT_S, GrammarCompiler
from blink.shared.service_class import ClassDefaults
from blink.shared.settings import Settings
from blink.shared.tokenizer import Tokenizer

T = TypeVar("T")
_DEFAULTS = Settings.model_fields
# Threads for a request's heavy work: tokenizers release the GIL, so they run side by side, one per core at most.
WORKERS = min(4, os.cpu_count() or 1)


@dataclass
class IngressState:
    info: EngineInfo
    tokenizer: Tokenizer
    client: IngressClient
    metrics: Metrics
    # The settings' defaults (blink serve passes its settings' values).
    max_request_bytes: int = _DEFAULTS["max_request_bytes"].default
    request_timeout_s: float = _DEFAULTS["request_timeout"].default
    api_key: str | None = None
    # The watchdog's deadline: an engine stepping within it is alive, and /ready says so.
    heartbeat_deadline_s: float = _DEFAULTS["watchdog_deadline"].default
    engine_status: Callable[[], EngineStatus | None] = lambda: None
    draining: bool = False
    seeds: secrets.SystemRandom = field(default_factory=secrets.SystemRandom)
    classes: ClassDefaults = field(default_factory=ClassDefaults)  # the control plane may replace it
    tool_parser: ToolParser | None = None  # --enable-auto-tool-choice --tool-call-parser's
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser's
    cors: CorsPolicy | None = None  # --allowed-origins and friends; None: no CORS
    # --generation-config's: the checkpoint's defaults for the knobs a request omits.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    chat_template: str | None = None  # --chat-template's, instead of the tokenizer's
    default_chat_template_kwargs: dict = field(default_factory=dict)  # under each request's chat_template_kwargs
    grammars: GrammarCompiler | None = None  # structured outputs' compiles (blink.ingress.structured), made when asked
    grammar_timeout_s: float = COMPILE_TIMEOUT_S  # a spec that compiles no faster is refused
    workers: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(WORKERS, thread_name_prefix="ingress-work"))

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """Runs a request's heavy work (tokenizing, templating, decoding a large input) off the event loop, which
        must stay free to stream tokens and answer the watchdog's pings."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)
        if self.grammars is not None:
            self.grammars.close()

    @property
    def degraded(self) -> bool:
        """Running a fallback: the engine on the CPU (no GPU), or requests relayed over ZeroMQ (no NIC path)."""
        return self.info.device.startswith("cpu") or transports.TRANSPORTS[self.transport].degraded

    @property
    def transport(self) -> str:
        return self.client.transport

    @property
    def in_flight(self) -> int:
        """Requests holding or waiting for a slot: what a drain waits for (uvicorn then flushes the responses)."""
        return self.client.running + self.client.waiting
