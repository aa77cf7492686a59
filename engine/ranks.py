"""The offline API's other ranks, with tensor parallelism: `LLM(model, tensor_parallel_size=N)` runs rank 0 in the
caller's process and starts ranks 1..N-1 as processes of their own, each an `LLM` over its slice of the model that
runs the very `generate` calls rank 0 runs (rank 0 sends them each call after validating it), so every rank steps
the same requests in lock-step; the collectives in the forward pass keep them there. Only rank 0's results are
returned. The ranks die with the caller (daemon processes) or when it closes the LLM.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
from multiprocessing.connection import Connection


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def agreed(model: str | None, engine_options: dict) -> dict:
    """The options with what each rank would resolve for itself resolved once, here: the dtype (`auto` depends on
    the CPU's flags, and ranks that disagreed would exchange tensors of different types)."""
    if engine_options.get("dtype", "auto") != "auto":
        return engine_options
    from pathlib import Path

    from blink.engine.device import auto_dtype, resolve_device
    from blink.engine.model.checkpoint import load_config
    from blink.engine.model.default_model import ensure_default_model

    cfg = load_config(Path(model) if model else ensure_default_model())
    dtype = auto_dtype(cfg.dtype, resolve_device(engine_options.get("device", "auto")))
    return {**engine_options, "dtype": str(dtype).removeprefix("torch.")}


class Ranks:
    """Ranks 1..N-1 of an LLM, each a process that replays rank 0's calls."""

    def __init__(self, model: str | None, engine_options: dict):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state inherited
        self._pipes: list[Connection] = []
        self._procs = []
        for rank in range(1, engine_options["tensor_parallel_size"]):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_serve_rank, args=(model, {**engine_options, "tensor_parallel_rank": rank},
                                                             theirs), daemon=True, name=f"blink-rank-{rank}")
            proc.start()
            self._pipes.append(ours)
            self._procs.append(proc)

    def generate(self, prompts, sampling_params) -> None:
        for pipe in self._pipes:
            pipe.send((prompts, sampling_params))

    def close(self) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.send(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self._pipes, self._procs = [], []


def _serve_rank(model: str | None, engine_options: dict, pipe: Connection) -> None:
    from blink.engine.llm import LLM

    llm = LLM(model, **engine_options)
    while (call := pipe.recv()) is not None:
        llm.generate(*call)
