"""What every benchmark records beside its figures: the machine it ran on and the code that ran."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path


def machine() -> dict[str, object]:
    """CPU, cores (and the ones this process may use), memory, GPUs with their driver, and versions.

    Imports no torch: the load generator runs wherever a client would."""
    return {"platform": platform.platform(), "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
            "logical_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "memory_total": _proc_field("/proc/meminfo", "MemTotal"), "python": sys.version.split()[0],
            "packages": {name: _version(name) for name in ("blink-serve", "torch", "transformers")},
            "gpus": gpus()}


def gpus() -> list[dict[str, object]]:
    """The NVIDIA GPUs NVML sees, with the driver; empty where there is no NVML (no NVIDIA driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: no GPU to describe
        return []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        return [{"name": pynvml.nvmlDeviceGetName(h), "driver": driver,
                 "memory_total_bytes": pynvml.nvmlDeviceGetMemoryInfo(h).total}
                for h in map(pynvml.nvmlDeviceGetHandleByIndex, range(pynvml.nvmlDeviceGetCount()))]
    except Exception as e:  # a query NVML refuses (NotSupported, NoPermission): said, never the run's end
        return [{"error": f"{type(e).__name__}: {e}"}]
    finally:
        pynvml.nvmlShutdown()


def blink_source() -> dict[str, object]:
    """Which Blink code ran: its directory, and the git commit and local changes there, when it is a checkout."""
    path = Path(__file__).resolve().parents[2]
    commit = _git(path, "rev-parse", "HEAD")
    changes = _git(path, "status", "--porcelain", "--", ".") if commit else None
    return {"path": str(path), "git_commit": commit, "modified": bool(changes) if commit else None}


def save(name: str, result: dict, results_dir: Path, path: Path | None = None) -> Path:
    """Writes NAME-TIMESTAMP.json (NAME-TIMESTAMP-2.json... when that exists), or rewrites `path`."""
    if path is None:
        results_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{name}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}"
        path = results_dir / f"{stem}.json"
        n = 1
        while path.exists():
            n += 1
            path = results_dir / f"{stem}-{n}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """Environment variables set for the block (an engine reads some, BLINK_KERNELS say, when it is built)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _proc_field(path: str, key: str) -> str | None:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), None)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _git(cwd: Path, *args: str) -> str | None:
    """A read-only git query; --no-optional-locks keeps `status` from rewriting the index."""
    try:
        return subprocess.run(["git", "--no-optional-locks", "-C", str(cwd), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
