"""Ranks 1..N-1 of a tensor-parallel engine, as processes that rank 0 starts and feeds.

Rank 0 is the caller's process: the offline API's (`LLM(model, tensor_parallel_size=N)`), or the engine service's
(`blink serve --tensor-parallel-size N`). Each other rank is a process of its own running an engine over its slice
of the model; rank 0 sends it what it needs to step the very requests rank 0 steps (the offline API: each
`generate` call, after validating it; the serve host mode: each step's inputs, blink.engine.drive.follower), and
the collectives in the forward pass keep the ranks in lock-step. Only rank 0's results are used. A rank dies with
rank 0 (its parent's death signal, and its pipe closing), and rank 0 learns of a rank that died (`lost`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from blink.shared.stopping import die_with_parent

# A rank's work: (model, its engine options, the pipe rank 0's messages arrive on; None ends it). A module-level
# function: it reaches the rank's fresh interpreter by name.
RankMain = Callable[[str | None, dict, Connection], None]


class RankLost(RuntimeError):
    """Another rank of a tensor-parallel engine is gone: the ranks step together or not at all."""


def meet(init: Callable[[], None], lost_rank: Callable[[], str | None] | None) -> None:
    """Runs `init`, which waits until every rank has joined (torch.distributed's rendezvous), but gives up as soon as
    `lost_rank` says a rank is gone: one that died before joining would keep it waiting for torch's default half
    hour. The rendezvous runs on a thread of its own (a blocked wait cannot be polled); given up on, it stays
    blocked there until that timeout, on a daemon thread."""
    if lost_rank is None:
        init()
        return
    failure: list[BaseException] = []

    def rendezvous() -> None:
        try:
            init()
        except BaseException as e:  # handed to the caller's thread
            failure.append(e)

    thread = threading.Thread(target=rendezvous, name="blink-rank-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        if thread.is_alive() and (why := lost_rank()):
            raise RankLost(f"{why} before the ranks met")
    if failure:
        raise failure[0]


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def agreed(model: str | None, engine_options: dict) -> dict:
    """The options with what each rank would resolve for itself resolved once, here: the dtype (`auto` depends on
    the CPU's flags, and ranks that disagreed would exchange tensors of different types)."""
    if engine_options.get("dtype", "auto") != "auto":
        return engine_options
    from blink.engine.device import auto_dtype, resolve_device
    from blink.engine.model.checkpoint import load_config
    from blink.shared.checkpoints.source import resolve

    cfg = load_config(resolve(model, revision=engine_options.get("revision"), check=load_config).path)
    dtype = auto_dtype(cfg.dtype, resolve_device(engine_options.get("device", "auto")))
    return {**engine_options, "dtype": str(dtype).removeprefix("torch.")}


class Ranks:
    """Ranks 1..N-1, each a process running `main` over the messages this process sends."""

    def __init__(self, model: str | None, engine_options: dict, main: RankMain):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state inherited
        self._pipes: list[Connection] = []
        self._procs = []
        for rank in range(1, engine_options["tensor_parallel_size"]):
            ours, theirs = context.Pipe()
            options = {**engine_options, "tensor_parallel_rank": rank}
            proc = context.Process(target=_run_rank, args=(main, model, options, theirs, os.getpid()), daemon=True,
                                   name=f"blink-rank-{rank}")
            proc.start()
            theirs.close()  # this process keeps only its end: the rank's recv ends when this process does
            self._pipes.append(ours)
            self._procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def send(self, message: object) -> None:
        for pipe in self._pipes:
            pipe.send(message)

    def lost(self) -> str | None:
        """Why a rank is gone, or None while every rank runs."""
        for rank, proc in enumerate(self._procs, start=1):
            if proc.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def check(self) -> None:
        """Raises RankLost, saying which, when a rank is gone."""
        if why := self.lost():
            raise RankLost(why)

    def close(self) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.send(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self._pipes, self._procs = [], []


def _run_rank(main: RankMain, model: str | None, engine_options: dict, inbox: Connection, parent: int) -> None:
    die_with_parent(signal.SIGKILL)  # a rank alone holds a slice of a model nobody serves
    if os.getppid() != parent:  # rank 0 died before the death signal was set
        return
    main(model, engine_options, inbox)


def replay_generate(model: str | None, engine_options: dict, inbox: Connection) -> None:
    """The offline API's other ranks: an `LLM` over this rank's slice running rank 0's `generate` calls."""
    from blink.engine.llm import LLM

    llm = LLM(model, **engine_options)
    while (call := inbox.recv()) is not None:
        llm.generate(*call)
