"""The engine service: owns the slot table, runs the drive loop over it, answers the control plane."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import structlog
import torch
import zmq

from blink.engine.device import resolve_device
from blink.engine.drive import modes as drive_modes
from blink.engine.drive.driver import Driver, Fenced
from blink.engine.drive.follower import follow
from blink.engine.engine import Engine, EngineConfig
from blink.engine.ranks import Ranks, agreed, free_init_method
from blink.services.relay import Relay
from blink.shared import control, sockets, transports
from blink.shared.rdma import RdmaUnavailable, TableTarget
from blink.shared.remote_memory import TransportLost
from blink.shared.settings import Settings
from blink.shared.slot_table import EngineState, Geometry, SlotTable
from blink.shared.stopping import StopFlag

log = structlog.get_logger()

# A table whose engine has not stepped for this long (or the watchdog's deadline, when longer: a step may take
# that long) belongs to a dead engine.
STALE_AFTER_S = 5.0


def open_table(name: str, geometry: Geometry, deadline_s: float = 0.0) -> SlotTable:
    """The deployment's slot table, in a new epoch. A table a dead engine left behind is taken over when its
    geometry matches, so an ingress still attached to it carries on (requests of the old epoch end there);
    otherwise it is replaced."""
    if not SlotTable.path_for(name).exists():
        return SlotTable.create(name, geometry)
    old = SlotTable.attach(name)
    idle_s = (time.monotonic_ns() - int(old.header["last_step_ns"])) / 1e9
    if old.header["engine_state"] != EngineState.STOPPED and idle_s < max(STALE_AFTER_S, deadline_s):
        old.close()
        raise RuntimeError(f"deployment {name!r} already has a live engine (slot table {old.path})")
    if old.geometry == geometry:
        old.take_over()
        return old
    epoch = int(old.header["epoch"]) + 1
    old.close()
    old.unlink()
    return SlotTable.create(name, geometry, epoch=epoch)


class EngineService:
    def __init__(self, settings: Settings):
        self.settings = settings
        options = dict(
            device=settings.device, dtype=settings.dtype, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens, max_model_len=settings.max_model_len,
            num_pages=settings.num_pages, scheduling_policy=settings.scheduling_policy, swap_space=settings.swap_space,
            revision=settings.revision, load_format=settings.load_format, quantization=settings.quantization,
            kv_cache_dtype=settings.kv_cache_dtype,
            enable_prefix_caching=settings.enable_prefix_caching, compile_bookkeeping=settings.compile_bookkeeping,
            tensor_parallel_size=settings.tensor_parallel_size,
            structured_outputs_backend=settings.structured_outputs_backend,
            grammar_arena_bytes=settings.grammar_arena_bytes,
            speculative_config=settings.speculative_config.model_dump() if settings.speculative_config else None,
        )
        # Which drive modes can run here is known before the model loads (minutes for a large one): a mode asked
        # for that cannot is refused first.
        self._modes = self._drive_modes(resolve_device(settings.device))
        self.ranks = None  # with tensor parallelism, the other ranks: this process is rank 0
        if settings.tensor_parallel_size > 1:
            options = agreed(settings.model, {**options, "distributed_init_method": free_init_method()})
            self.ranks = Ranks(settings.model, options, follow)
        self.engine = Engine(EngineConfig(model=settings.model, **options),
                             lost_rank=self.ranks.lost if self.ranks else None)
        geometry = self.engine.geometry(settings.window, max_grammar_bytes=settings.max_grammar_bytes)
        self.keys = sockets.load_keys(settings, create=True)
        self.table = open_table(settings.deployment, geometry, settings.watchdog_deadline)
        self.driver = self._build_driver()
        self.rdma, self.rdma_missing = self._rdma_target()
        self._stop = StopFlag()
        self.info = control.EngineInfo(
            slot_table=settings.deployment, num_slots=geometry.num_slots, epoch=int(self.table.header["epoch"]),
            served_model_names=settings.served_model_name or [self.engine.model_name],
            model_dir=str(self.engine.model_dir),
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.model_config.vocab_size,
            eos_token_ids=list(self.engine.generation.eos_token_ids), device=str(self.engine.device),
            drive=self.driver.mode, pid=os.getpid(), rank_pids=self.ranks.pids if self.ranks else [],
            scheduling_policy=settings.scheduling_policy,
            kv_host_pages=self.driver.mirror.num_pages - 1 if self.driver.mirror else 0,
            prefix_caching=settings.enable_prefix_caching, kv_cache_dtype=settings.kv_cache_dtype,
            limitations=list(self.driver.limitations),
            max_grammar_bytes=geometry.max_grammar_bytes,
        )
        log.info("drive mode", mode=self.driver.mode, kv_host_pages=self.info.kv_host_pages, **self.info.policies())

    def _drive_modes(self, device: torch.device) -> list[str]:
        """The drive modes to try on `device`, best first, the others logged with the reason; none is an error."""
        requested = self.settings.drive
        modes, passed_over = drive_modes.candidates(requested, device, self.settings.tensor_parallel_size,
                                                    self.settings.compile_bookkeeping)
        for reason in passed_over:
            log.info("drive mode unavailable", reason=reason)
        if not modes:
            raise RuntimeError(f"--drive {requested} cannot run here: {'; '.join(passed_over)}")
        return modes

    def _build_driver(self) -> Driver:
        """The best drive mode that starts here, falling back with the reason logged; or the one asked for, which
        starts or stops the engine with the reason."""
        requested = self.settings.drive
        for mode in self._modes:
            try:
                driver = drive_modes.build(mode, self.engine, self.table, self.ranks)
            except Exception as e:  # a capture or a build that fails here must not keep the engine down
                if requested != "auto":
                    raise RuntimeError(f"--drive {mode} failed to start: {e}") from e
                log.warning("drive mode failed to start; falling back", mode=mode, reason=str(e)[:500])
                continue
            for limitation in driver.limitations:
                log.warning("drive mode limitation", mode=mode, limitation=limitation)
            return driver
        raise RuntimeError(f"no drive mode started (tried {', '.join(self._modes)})")

    def _rdma_target(self) -> tuple[TableTarget | None, str]:
        """The table registered for remote access, when the deployment may use rdma; else why not."""
        if not transports.may_use(self.settings.transport, "rdma"):
            return None, f"the deployment's transport is {self.settings.transport}"
        try:
            target = TableTarget(self.table.mapping, self.settings.rdma_device, self.settings.rdma_gid_index)
        except RdmaUnavailable as e:
            (log.warning if self.settings.transport == "rdma" else log.info)("no rdma target", reason=str(e))
            return None, str(e)
        log.info("slot table registered for rdma", device=target.port.name, gid=target.port.gid)
        return target, ""

    def run(self) -> None:
        self._stop.install()
        control_thread = threading.Thread(target=self._serve_control, name="control", daemon=True)
        control_thread.start()
        relay = None
        if transports.may_use(self.settings.transport, "zmq"):  # the relay is the zmq transport's engine end
            relay = Relay(self.table, self.settings.bind_address(self.settings.relay_endpoint), self.keys,
                          self.settings.max_waiting, self.settings.reserved_slots(self.engine.state.num_slots),
                          self.settings.by_class)
            relay.start()
        self.table.heartbeat()  # the first one of this life: the header may still hold a dead engine's
        self.table.header["engine_state"] = EngineState.READY
        log.info("engine ready", **self.info.model_dump(exclude={"type"}), slots=self.table.geometry.num_slots)
        log.info("drive mode", drive=self.driver.mode)
        try:
            self._drive()
        except Fenced as e:
            log.error("engine fenced off: exiting without touching the table", reason=str(e))
            raise SystemExit(3) from None
        else:
            self.table.fail_over(failed=False)  # requests still held end with an error event, not a hang
            self.table.remove_if_abandoned()  # else an ingress still maps it, for the next engine to take over
            log.info("engine stopped")
        finally:
            if relay is not None:
                relay.stop()
            if self.rdma is not None:
                self.rdma.close()
            self.driver.close()  # unmaps the table from the device before it is closed
            self.table.close()
            if self.ranks is not None:
                self.ranks.close()

    def _drive(self) -> None:
        """The driver steps by itself; this thread only vouches for it to the watchdog: alive while its progress
        moves, or while it has nothing to do. A driver that stops with work waiting gets no heartbeat, and one that
        failed ends the service (the watchdog restarts it)."""
        self.driver.start()
        seen = -1
        try:
            while not self._stop.is_set():
                time.sleep(0.005)
                if self.driver.failure is not None:
                    raise self.driver.failure
                if self.ranks is not None:
                    self.ranks.check()  # the ranks step together or not at all: a lost one fails the engine over
                if int(self.table.header["epoch"]) != self.info.epoch:
                    raise Fenced(f"the slot table moved to epoch {int(self.table.header['epoch'])}")
                progress = self.driver.progress()
                if progress != seen or self.driver.idle():  # idle: every reader is behind, or nothing to do
                    self.table.stamp()
                seen = progress
        finally:
            self.driver.stop()  # after the step in flight: what it wrote is whole

    def _serve_control(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        endpoint = self.settings.bind_address(self.settings.control_endpoint)
        sockets.bind(sock, endpoint, self.keys)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                reply = self._handle(control.decode(sock.recv()))
            except ValueError as e:  # a message that does not decode, or an order refused
                reply = control.Failure(message=str(e)[:200])
            except Exception as e:  # anything else must not end the thread: nothing would answer again
                log.exception("control_message_failed")
                reply = control.Failure(message=f"{type(e).__name__}: {e}"[:200])
            sock.send(control.encode(reply))
        sock.close()
        sockets.unlink_ipc(endpoint)

    def _handle(self, message: control.Message) -> control.Message:
        if isinstance(message, control.Hello):
            return self.info
        if isinstance(message, control.GetStatus):
            state, pool, mirror = self.engine.state, self.engine.pool, self.driver.mirror
            host_total = mirror.num_pages - 1 if mirror else 0
            return control.EngineStatus(
                state=EngineState(int(self.table.header["engine_state"])).name.lower(),
                epoch=self.info.epoch, steps=int(self.table.header["steps"]), running=self.driver.resident,
                kv_pages_used=pool.usable_pages - int(pool.num_free), kv_pages_total=pool.usable_pages,
                preemptions=int(state.num_preemptions),
                kv_host_pages_used=host_total - int(mirror.free.num_free) if mirror else 0,
                kv_host_pages_total=host_total,
                **_speculation_counts(self.engine),
                structured_output_ended=dict(getattr(self.engine.step.grammar, "ended", {})),  # none: no grammar yet
                **_grammar_arena(self.engine),
            )
        if isinstance(message, control.RdmaConnect):
            return self._accept_rdma(message.peer)
        if isinstance(message, control.SetLimits):
            self.driver.set_admission_limit(message.max_running)
            self.table.set_admission_limit(message.max_running)  # what /ready tells of it
            log.warning("admission limit set", max_running=message.max_running)
            return control.Ack()
        if isinstance(message, control.Drain | control.Resume):
            draining = isinstance(message, control.Drain)
            self.table.header["engine_state"] = EngineState.DRAINING if draining else EngineState.READY
            log.warning("draining" if draining else "resumed")
            return control.Ack()
        if isinstance(message, control.Stop):
            self._stop.set()
            return control.Ack()
        return control.Failure(message=f"unexpected message {message.type!r}")

    def _accept_rdma(self, remote: control.RdmaPeer) -> control.Message:
        if self.rdma is None:
            return control.Failure(message=f"the engine host has no rdma target: {self.rdma_missing}")
        try:
            peer, address, rkey = self.rdma.accept(remote)
        except TransportLost as e:
            return control.Failure(message=str(e))
        g = self.table.geometry
        log.info("rdma queue pair up", remote_device=remote.device, remote_gid=remote.gid, qp_num=peer.qp_num)
        return control.RdmaAccept(peer=peer, address=address, rkey=rkey, size=self.rdma.size, geometry=g,
                                  epoch=int(self.table.header["epoch"]))


def run_engine(settings: Settings) -> None:
    pid_file = settings.engine_pid_file
    sockets.private_dir(settings, create=True)
    pid_file.write_text(str(os.getpid()))  # before the model loads, which is where an engine may hang
    try:
        EngineService(settings).run()
    finally:
        with contextlib.suppress(OSError):
            if pid_file.read_text() == str(os.getpid()):
                pid_file.unlink()


def _grammar_arena(engine: Engine) -> dict:
    """The device grammar arena's figures (none in the host mode, whose grammars have no arena)."""
    usage = getattr(engine.step.grammar, "arena_usage", None)
    figures = usage() if usage is not None else None
    if figures is None:
        return {}
    used, total, tables = figures
    return {"grammar_arena_bytes_used": used, "grammar_arena_bytes_total": total, "grammar_tables_resident": tables}


def _speculation_counts(engine: Engine) -> dict:
    """vLLM's speculative decoding counters from the engine's state (none when it does not speculate)."""
    spec = engine.step.speculation
    if spec is None:
        return {}
    drafts, draft_tokens, accepted = engine.state.spec_counts.tolist()
    return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_num_accepted_tokens_per_pos": engine.state.spec_accepted_per_pos[:spec.k].tolist()}
