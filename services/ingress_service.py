"""The ingress service: handshake with the engine, map its slot table, serve HTTP until drained."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import structlog
import uvicorn
import uvloop
import zmq
import zmq.asyncio

from blink.ingress.app import create_app
from blink.ingress.chat import load_chat_template
from blink.ingress.connect import connect, open_client
from blink.ingress.cors import CorsPolicy
from blink.ingress.generation_config import SamplingDefaults
from blink.ingress.header_deadline import with_header_deadline
from blink.ingress.metrics import Metrics
from blink.ingress.reasoning import PARSERS as REASONING_PARSERS
from blink.ingress.state import IngressState
from blink.ingress.tools import PARSERS
from blink.ingress.zmq_api import ZmqApi
from blink.services import listener
from blink.shared import control, sockets
from blink.shared.checkpoints.source import resolve
from blink.shared.settings import Settings
from blink.shared.tokenizer import Tokenizer

log = structlog.get_logger()
TABLE_CHECK_S = 0.5  # how often the ingress looks whether a restarted engine made a new slot table


def handshake(settings: Settings, keys: sockets.Keys, timeout_s: float, alive=lambda: True) -> control.EngineInfo:
    """Asks the engine for its info until it answers; gives up at the deadline or when `alive()` turns false."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not alive():
            raise RuntimeError("the engine exited before it answered the handshake")
        try:
            reply = control.request(settings.control_endpoint, control.Hello(), keys, timeout_s=1.0)
            if isinstance(reply, control.EngineInfo):
                return reply
        except TimeoutError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no engine answered at {settings.control_endpoint} within {timeout_s} s")
        time.sleep(0.2)


class DrainingServer(uvicorn.Server):
    """On SIGTERM or SIGINT: answer new requests 503, let in-flight ones finish (within the timeout), exit."""

    def __init__(self, config: uvicorn.Config, state: IngressState, timeout_s: float):
        super().__init__(config)
        self.blink, self.timeout_s = state, timeout_s

    def handle_exit(self, sig, frame) -> None:
        if self.blink.draining:
            return super().handle_exit(sig, frame)  # a second signal: stop now
        self.blink.draining = True
        log.info("draining", in_flight=self.blink.in_flight, timeout_s=self.timeout_s)
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(sig, frame)))

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn re-raises the captured signal once it has served, which would kill the process before the
        ingress releases the table; a drained ingress exits by returning instead."""
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()

    async def _drain(self, sig, frame) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.blink.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        log.info("drained", unfinished=self.blink.in_flight)
        super().handle_exit(sig, frame)


def tokenizer_dir(settings: Settings, info: control.EngineInfo) -> Path:
    """The engine's checkpoint directory where this host has it; on another host, --model resolved here, its
    tokenizer's files only."""
    if Path(info.model_dir).is_dir():
        return Path(info.model_dir)
    return resolve(settings.model, weights=False, revision=settings.revision).path


async def serve(settings: Settings, keys: sockets.Keys, info: control.EngineInfo) -> None:
    client = connect(settings, keys, info)
    client.start()

    def engine_status() -> control.EngineStatus | None:
        try:
            reply = control.request(settings.control_endpoint, control.GetStatus(), keys, timeout_s=0.5)
        except TimeoutError:
            return None
        return reply if isinstance(reply, control.EngineStatus) else None

    model_dir = tokenizer_dir(settings, info)
    state = IngressState(info=info, tokenizer=Tokenizer(model_dir), client=client,
                         metrics=Metrics(info.model, info.drive, client.transport, info.policies()),
                         max_request_bytes=settings.max_request_bytes, request_timeout_s=settings.request_timeout,
                         api_key=settings.api_key, heartbeat_deadline_s=settings.watchdog_deadline,
                         engine_status=engine_status, classes=settings.class_defaults(),
                         tool_parser=PARSERS[settings.tool_call_parser] if settings.enable_auto_tool_choice else None,
                         chat_template=load_chat_template(settings.chat_template) if settings.chat_template else None,
                         default_chat_template_kwargs=settings.default_chat_template_kwargs,
                         reasoning_parser=REASONING_PARSERS.get(settings.reasoning_parser),
                         cors=CorsPolicy.of(settings),
                         sampling_defaults=SamplingDefaults.read(settings.generation_config, [model_dir]))
    log.info("ingress transport", transport=client.transport, degraded=state.degraded)
    config = uvicorn.Config(create_app(state), host=settings.host, port=settings.port, loop="none",
                            http=with_header_deadline(settings.request_timeout), log_config=None, access_log=False,
                            timeout_graceful_shutdown=settings.shutdown_timeout)
    server = DrainingServer(config, state, settings.shutdown_timeout)
    zmq_api = asyncio.create_task(ZmqApi(state, settings.zmq_endpoint).serve())
    orders = asyncio.create_task(IngressControl(state, settings, keys).serve())
    follower = asyncio.create_task(restart_when_replaced(state))
    handed = listener.inherited()
    try:
        await server.serve(sockets=[handed] if handed is not None else None)
    finally:
        zmq_api.cancel()
        orders.cancel()
        follower.cancel()
        await state.client.stop()
        state.close()
        state.client.close()


async def restart_when_replaced(state: IngressState) -> None:
    """An engine that restarted with another table geometry (its context limit fitted to the memory it found free)
    made a new table; the requests this ingress published into the old one reach no engine. They end with the
    engine's failure (as those a dead engine held do), and the ingress drains and exits, to be started again by its
    supervisor (`blink serve`'s watchdog, or the orchestrator) and handshake with the new engine."""
    while not state.client.replaced():
        await asyncio.sleep(TABLE_CHECK_S)
    log.warning("slot table replaced by a restarted engine: ending what was in flight and restarting",
                running=state.client.running, waiting=state.client.waiting)
    state.client.end_all()
    signal.raise_signal(signal.SIGTERM)  # DrainingServer: a 503 for new requests, the ended ones answered, exit


class IngressControl:
    """The ingress's control socket: the watchdog's probe (answered from the event loop, so a blocked or stopped
    loop goes unanswered) and the deployment's orders, from its members only (CURVE)."""

    def __init__(self, state: IngressState, settings: Settings, keys: sockets.Keys):
        self.state, self.settings, self.keys = state, settings, keys

    async def serve(self) -> None:
        endpoint = self.settings.ingress_control_endpoint
        sock = zmq.asyncio.Context.instance().socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sockets.bind(sock, endpoint, self.keys)
        try:
            while True:
                frame = await sock.recv()
                try:
                    reply = await self._answer(control.decode(frame))
                except Exception as e:  # a bad order must not silence the watchdog's pings
                    reply = control.Failure(message=f"{type(e).__name__}: {e}"[:200])
                await sock.send(control.encode(reply))
        finally:
            sock.close()
            sockets.unlink_ipc(endpoint)

    async def _answer(self, message: control.Message) -> control.Message:
        state = self.state
        if isinstance(message, control.Ping):
            client = state.client
            return control.IngressStatus(pid=os.getpid(), running=client.running, waiting=client.waiting,
                                         failovers=client.failed_over, draining=state.draining,
                                         transport=client.transport,
                                         transport_lost=client.transport_lost)
        if isinstance(message, control.SwitchTransport):
            return await self.switch(message.transport)
        if isinstance(message, control.SetClassDefaults):
            state.classes = message.applied_to(state.classes)
            log.info("class defaults changed", **state.classes.model_dump())
            return control.ClassDefaultsNow(defaults=state.classes)
        return control.Failure(message=f"unexpected message {message.type!r}")

    async def switch(self, to: str) -> control.Message:
        """Moves to transport `to` (the relay: blink.shared.transports.LAST_RESORT): once it answers, the table
        client hands its requests over, those in flight adopted (read on from what was consumed, into the same
        queues) and those waiting for a slot sent on."""
        state, settings = self.state, self.settings
        old = state.client
        if old.transport == to:
            return control.Ack()
        new = open_client(to, settings, self.keys, state.info)
        new.start()
        # Pings wait meanwhile: stay well inside the watchdog's deadline.
        deadline = time.monotonic() + min(1.0, settings.watchdog_deadline / 2)
        while new.health().state == "unreachable":
            if time.monotonic() > deadline:
                await new.stop()
                return control.Failure(message=f"the relay at {settings.relay_endpoint} did not answer")
            await asyncio.sleep(0.02)
        state.client = new
        adopted = await new.take_over(old)
        state.metrics.set_transport(new.transport)
        log.warning(f"transport switched to {to}", adopted=adopted)
        return control.Ack()


def run_ingress(settings: Settings, engine_timeout_s: float = 600.0) -> None:
    keys = sockets.load_keys(settings, create=True)
    info = handshake(settings, keys, engine_timeout_s)
    log.info("ingress starting", url=f"http://{settings.host}:{settings.port}", model=info.model, epoch=info.epoch,
             drive=info.drive, device=info.device)
    uvloop.run(serve(settings, keys, info))
