"""The watchdog: notices a dead or stalled engine or ingress within a deadline, and fails over.

The engine is watched through the slot table's header (its loop stamps a heartbeat every pass, busy or idle);
the ingress through pings on its control socket, answered from its event loop. On a failure the watchdog kills
what is left of the service, and for the engine declares its epoch over in the table (the ingress then ends
the requests that engine held with an error event and resubmits those it never admitted), then has the
service restarted. Every decision is a JSON log line and an event on a ZeroMQ PUB socket.

Restarting is the supervisor's job: `blink serve` owns the processes and starts new ones; a standalone
`blink watchdog` (compose) kills by pid and leaves the restart to the orchestrator's restart policy.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog
import zmq
from pydantic import BaseModel, SecretStr

from blink.services import listener
from blink.shared import control, sockets, transports
from blink.shared.cpus import parse_cpus
from blink.shared.settings import Settings
from blink.shared.slot_table import EngineState, SlotTable
from blink.shared.stopping import StopFlag, die_with_parent, terminate

log = structlog.get_logger()

ENGINE, INGRESS = "engine", "ingress"
INGRESS_START_S = 120.0  # an ingress may take this long to import, handshake and answer its first ping


class Supervisor(Protocol):
    def alive(self, service: str) -> bool: ...

    def kill(self, service: str) -> None: ...

    def restart(self, service: str) -> None: ...


def _variable(value: object) -> str:
    """A setting as its BLINK_* variable: lists, mappings and configs (--speculative-config) as JSON, which Settings
    reads back."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, BaseModel):
        return value.model_dump_json(exclude_none=True)
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


class ProcessSupervisor:
    """Owns the engine and ingress processes of `blink serve`: each in its own session, so a terminal's ^C
    reaches only `blink serve`, which stops them in order."""

    def __init__(self, settings: Settings, http_socket: socket.socket | None = None):
        """http_socket: the HTTP port's, held by `blink serve` and handed to each ingress (blink.services.listener)."""
        values = {k: getattr(settings, k) for k in Settings.model_fields}
        self.env = os.environ | {f"BLINK_{k.upper()}": _variable(v) for k, v in values.items() if v is not None}
        self.procs: dict[str, subprocess.Popen] = {}
        self.handed = {INGRESS: http_socket.fileno()} if http_socket is not None else {}  # service: its inherited fd
        self.cpus = {service: parse_cpus(cpus) for service, cpus in
                     ((ENGINE, settings.engine_cpus), (INGRESS, settings.ingress_cpus)) if cpus}

    def start(self, service: str) -> subprocess.Popen:
        cpus = self.cpus.get(service)

        def prepare() -> None:  # in the child, before it runs
            die_with_parent()  # a drain when `blink serve` dies, even by SIGKILL
            if cpus:
                os.sched_setaffinity(0, cpus)

        fd = self.handed.get(service)
        env = self.env if fd is None else self.env | {listener.ENV: str(fd)}
        proc = subprocess.Popen([sys.executable, "-m", "blink.services.cli", service], env=env,
                                start_new_session=True, preexec_fn=prepare, pass_fds=() if fd is None else (fd,))
        self.procs[service] = proc
        return proc

    def alive(self, service: str) -> bool:
        proc = self.procs.get(service)
        return proc is not None and proc.poll() is None

    def kill(self, service: str) -> None:
        proc = self.procs.get(service)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, service: str) -> None:
        self.kill(service)
        self.start(service)

    def stop(self, service: str, grace_s: float) -> None:
        """SIGTERM (which drains), then SIGKILL after the grace period."""
        proc = self.procs.get(service)
        if proc is not None:
            terminate(proc, grace_s)


class PidSupervisor:
    """For a watchdog that did not start the services (compose): pids come from their handshakes (an engine's also
    from the pid file it writes as it starts, so one that hangs loading can be killed), kills need a shared pid
    namespace, restarts come from the orchestrator's restart policy."""

    def __init__(self, engine_pid_file: Path | None = None) -> None:
        self.pids: dict[str, int] = {}
        self.engine_pid_file = engine_pid_file

    def alive(self, service: str) -> bool:
        pid = self.pids.get(service)
        if pid is None:
            return True  # not yet known: judged by its heartbeat or pings alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def kill(self, service: str) -> None:
        pid = self.pids.pop(service, None)
        if pid is None and service == ENGINE:
            pid = self._engine_from_file()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError) as e:
                log.warning("could not kill", service=service, pid=pid, error=str(e))

    def restart(self, service: str) -> None:
        self.kill(service)
        log.info("left to the orchestrator to restart", service=service)

    def _engine_from_file(self) -> int | None:
        """The pid the engine wrote, if that process is a Blink engine still (a pid is reused once its process is
        gone: the file of a dead engine names another process sooner or later)."""
        try:
            pid = int(self.engine_pid_file.read_text()) if self.engine_pid_file else None
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if pid else []
        except (OSError, ValueError):
            return None
        return pid if b"engine" in argv and any(b"blink" in part for part in argv) else None


@dataclass
class Watch:
    """What the watchdog knows of one service."""

    starting_since: float | None  # monotonic time of its (re)start; None once it proved alive
    failures: int = 0


class Watchdog:
    def __init__(self, settings: Settings, supervisor: Supervisor, now: float | None = None):
        self.settings, self.supervisor = settings, supervisor
        self.deadline_s = settings.watchdog_deadline
        start = time.monotonic() if now is None else now
        self.watch = {ENGINE: Watch(start), INGRESS: Watch(start)}
        self.table: SlotTable | None = None
        self._table_inode: int | None = None
        self._engine_ready_at = -float("inf")
        self.keys = sockets.load_keys(settings, create=True)
        self.events = zmq.Context.instance().socket(zmq.PUB)
        self.events.setsockopt(zmq.LINGER, 0)
        sockets.bind(self.events, settings.events_endpoint, self.keys)  # subscribers are members too
        self._ping: zmq.Socket | None = None
        self._awaiting = False  # a ping is in flight on _ping
        self._ping_sent = 0.0
        self._last_answer = 0.0
        self._lost_since: float | None = None  # when the ingress first said its transport's path was lost

    # -- the loop ------------------------------------------------------------------------------------------

    def run(self, stop: StopFlag) -> None:
        tick = min(0.1, self.deadline_s / 10)
        self.announce("watchdog_started", deadline_s=self.deadline_s)
        try:
            while not stop.is_set():
                time.sleep(tick)
                if not stop.is_set():
                    self.check()
        finally:
            self.close()

    def check(self) -> None:
        now = time.monotonic()
        if (reason := self.engine_failure(now)) is not None:
            self.fail_engine(reason)
        if (reason := self.ingress_failure(now)) is not None:
            self.fail_ingress(reason)

    # -- the engine ----------------------------------------------------------------------------------------

    def engine_failure(self, now: float) -> str | None:
        watch = self.watch[ENGINE]
        if not self.supervisor.alive(ENGINE):
            return "exited"
        header = self._header()
        if watch.starting_since is not None:
            if header is not None and int(header["engine_state"]) == EngineState.READY:
                self._engine_ready()
                return None
            if now - watch.starting_since > self.settings.engine_start_timeout:
                return f"not ready within {self.settings.engine_start_timeout} s of its start"
            return None
        if header is None or int(header["engine_state"]) not in (EngineState.READY, EngineState.DRAINING):
            return None
        age_s = min((time.monotonic_ns() - int(header["last_step_ns"])) / 1e9, now - self._engine_ready_at)
        return f"stalled: no heartbeat for {age_s:.1f} s" if age_s > self.deadline_s else None

    def _engine_ready(self) -> None:
        watch = self.watch[ENGINE]
        watch.starting_since = None
        self._engine_ready_at = time.monotonic()
        if isinstance(self.supervisor, PidSupervisor):  # it learns pids from the handshake
            try:
                info = control.request(self.settings.control_endpoint, control.Hello(), self.keys, timeout_s=0.5)
            except TimeoutError:
                info = None
            if isinstance(info, control.EngineInfo):
                self.supervisor.pids[ENGINE] = info.pid
        epoch = int(self.table.header["epoch"]) if self.table is not None else None
        self.announce("engine_ready", epoch=epoch, restarts=watch.failures)

    def fail_engine(self, reason: str) -> None:
        """Kill first, then end the epoch: a stopped engine that resumed must find its epoch over."""
        watch = self.watch[ENGINE]
        watch.failures += 1
        self.supervisor.kill(ENGINE)
        if self.table is None:
            self._header()
        # The table this watchdog maps, even if the engine unlinked it: an ingress may still map that one too.
        epoch = self.table.fail_over() if self.table is not None else None
        self.announce("engine_failed", reason=reason, new_epoch=epoch, failures=watch.failures)
        self.supervisor.restart(ENGINE)
        watch.starting_since = time.monotonic()

    def _header(self):
        """The slot table's header, (re)attached when the engine created a new table file."""
        try:
            inode = SlotTable.path_for(self.settings.deployment).stat().st_ino
        except FileNotFoundError:
            inode = None
        if self.table is not None and inode != self._table_inode:
            self.table.close()
            self.table = None
        if self.table is None and inode is not None:
            try:
                self.table, self._table_inode = SlotTable.attach(self.settings.deployment), inode
            except (FileNotFoundError, ValueError):
                return None
        return self.table.header if self.table is not None else None

    # -- the ingress ---------------------------------------------------------------------------------------

    def ingress_failure(self, now: float) -> str | None:
        watch = self.watch[INGRESS]
        if not self.supervisor.alive(INGRESS):
            return "exited"
        answered = self._poll_ping(now)
        if answered is not None:
            self._watch_transport(answered, now)
        if answered is not None and watch.starting_since is not None:
            watch.starting_since = None
            if isinstance(self.supervisor, PidSupervisor):
                self.supervisor.pids[INGRESS] = answered.pid
            self.announce("ingress_ready", restarts=watch.failures)
        if watch.starting_since is not None:
            # An ingress waits for the engine's handshake before it answers: give it the engine's time too.
            limit_s = INGRESS_START_S + self.settings.engine_start_timeout
            late = now - watch.starting_since > limit_s
            return f"no answer within {limit_s:.0f} s of its start" if late else None
        if now - self._last_answer > self.deadline_s:
            return f"stalled: no answer to pings for {now - self._last_answer:.1f} s"
        return None

    def _watch_transport(self, status: control.IngressStatus, now: float) -> None:
        """An ingress that cannot restore its path to the table (rdma) within the deadline is moved to the transport
        of last resort (`zmq`), whose relay adopts the requests in flight."""
        if status.transport_lost is None:
            self._lost_since = None
            return
        self._lost_since = self._lost_since if self._lost_since is not None else now
        if now - self._lost_since <= self.deadline_s:
            return
        self.announce("transport_lost", transport=status.transport, reason=status.transport_lost)
        to = transports.LAST_RESORT
        try:
            reply = control.request(self.settings.ingress_control_endpoint, control.SwitchTransport(transport=to),
                                    self.keys, timeout_s=self.deadline_s)
        except TimeoutError as e:
            reply = control.Failure(message=str(e))
        switched = isinstance(reply, control.Ack)
        self.announce("transport_switched" if switched else "transport_switch_failed", to=to,
                     reason=None if switched else getattr(reply, "message", reply.type))
        self._lost_since = None if switched else now  # a failed switch is tried again after another deadline

    def _poll_ping(self, now: float) -> control.IngressStatus | None:
        """Keeps one ping in flight on one socket (its CURVE handshake done once); returns the answer when one came
        in."""
        answer = None
        if self._ping is not None and self._awaiting and self._ping.poll(0):
            reply = control.decode(self._ping.recv())
            self._awaiting = False
            if isinstance(reply, control.IngressStatus):
                self._last_answer, answer = now, reply
        if self._ping is not None and self._awaiting and now - self._ping_sent > self.deadline_s:
            self._ping.close()  # a REQ socket with a lost request cannot send again
            self._ping = None
        if self._ping is None:
            self._ping = zmq.Context.instance().socket(zmq.REQ)
            self._ping.setsockopt(zmq.LINGER, 0)
            sockets.connect(self._ping, self.settings.ingress_control_endpoint, self.keys)
            self._awaiting = False
        if not self._awaiting:
            self._ping.send(control.encode(control.Ping()))
            self._ping_sent, self._awaiting = now, True
        return answer

    def fail_ingress(self, reason: str) -> None:
        watch = self.watch[INGRESS]
        watch.failures += 1
        self.announce("ingress_failed", reason=reason, failures=watch.failures)
        if self._ping is not None:
            self._ping.close()
            self._ping = None
        self.supervisor.restart(INGRESS)
        watch.starting_since = time.monotonic()

    # -- reporting -----------------------------------------------------------------------------------------

    def announce(self, event: str, **fields: object) -> None:
        (log.warning if event.endswith("failed") else log.info)(event, **fields)
        body = {"event": event, "deployment": self.settings.deployment, "time": time.time(), **fields}
        self.events.send(json.dumps(body).encode())

    def close(self) -> None:
        if self._ping is not None:
            self._ping.close()
        self.events.close()
        sockets.unlink_ipc(self.settings.events_endpoint)
        if self.table is not None:
            self.table.close()



def run_watchdog(settings: Settings) -> None:
    """`blink watchdog`: watches services it did not start, until SIGTERM."""
    Watchdog(settings, PidSupervisor(settings.engine_pid_file)).run(StopFlag().install())
