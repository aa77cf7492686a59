"""The CPU's fused kernels (cpu.cpp) and projections (blocked_linear.cpp, amx_linear.cpp, quant_linear.cpp), whose
parallel sections run on threads of their own (pool.cpp, which says why not torch's): built once per machine with
torch's C++ extension tooling, then loaded from the build directory.

The build needs a C++ compiler (g++ or clang++, found as torch finds it: $CXX, else c++) and ninja (the `ninja`
wheel is an engine dependency); it takes about ten seconds on two cores and is kept in Blink's cache directory
(blink.shared.model_cache.cache_root, ~/.cache/blink by default) under cpu-kernels/, one directory per CPU, Python
and torch, since it is compiled for the CPU it runs on (-march=native). `ops()` returns torch.ops.blink_cpu, or
raises `Unavailable` saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

from blink.shared.model_cache import cache_root

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("cpu.cpp", "blocked_linear.cpp", "amx_linear.cpp",
                                                          "quant_linear.cpp", "pool.cpp", "cpu_draft.cpp",
                                                          "cpu_hand_out.cpp", "cpu_make_room.cpp",
                                                          "cpu_commit.cpp", "cpu_lay_out.cpp")]
# OpenMP: torch's threads' runtime, which pool.cpp quiets and falls back on. No contraction: a * b + c * d as two
# products and a sum, rounded where torch's separate ops round.
# decode_attention's float row of a key or value lives on the stack. 256 covers Llama, Qwen, Mistral and Gemma; a
# larger one slowed the bfloat16 kernel 2.3x at 512 keys on the EPYC (store-to-load aliasing, by its symptoms).
MAX_HEAD_DIM = 256
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", f"-DBLINK_MAX_HEAD_DIM={MAX_HEAD_DIM}"]


class Unavailable(RuntimeError):
    """The kernels cannot be built or loaded here (no compiler, say): the torch reference runs instead."""


def build_dir() -> Path:
    cpu = _cpu_identity()
    tag = hashlib.sha256(f"{cpu}|{sys.version}|{torch.__version__}".encode()).hexdigest()[:16]
    return cache_root() / "cpu-kernels" / tag


def _cpu_identity() -> str:
    """What -march=native compiles for: the model name and feature flags of the first CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))


_loaded = None  # torch.ops.blink_cpu once loaded, or the Unavailable that said why not: tried once per process


def ops():
    """torch.ops.blink_cpu, built on first use in this process (later processes load the build)."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    if isinstance(_loaded, Unavailable):
        raise Unavailable(str(_loaded))
    return _loaded


@contextlib.contextmanager
def _only_loader(directory: Path):
    """One process at a time loads (and, if need be, builds) from `directory`. torch's own lock there is a file
    that every load creates and removes, so a process killed inside a load (an engine the watchdog killed while
    it started) leaves it behind, and every later load waits on it forever. This lock is the kernel's, released
    with its holder however it ends; whoever holds it knows a torch lock file it finds is such a leftover."""
    with open(directory / "load.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def _load():
    try:
        import ninja  # the wheel puts the binary beside its module; torch looks for it on PATH
        from torch.utils import cpp_extension
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        log.info("cpu kernels: loading (built once per machine, under %s)", directory)
        with _only_loader(directory):
            cpp_extension.load(name="blink_cpu", sources=[str(source) for source in SOURCES], extra_cflags=FLAGS,
                               build_directory=str(directory), is_python_module=False, verbose=False)
    except Exception as e:  # a missing compiler or ninja surfaces as several exception types
        return Unavailable(f"the CPU kernels could not be built ({type(e).__name__}: {e}); they need a C++ "
                           "compiler and ninja")
    return torch.ops.blink_cpu
