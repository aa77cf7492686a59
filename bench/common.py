"""What every benchmark records: the machine, the engine's source, and where results go."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, object]:
    def proc_field(path: str, key: str) -> str | None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            return None
        return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), None)

    gpu = None
    if torch.cuda.is_available():
        gpu = {"name": torch.cuda.get_device_name(0), "driver": _nvidia_driver()}
    return {"platform": platform.platform(), "cpu_model": proc_field("/proc/cpuinfo", "model name"),
            "logical_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "memory_total": proc_field("/proc/meminfo", "MemTotal"), "python": sys.version.split()[0],
            "torch": torch.__version__, "gpu": gpu}


def blink_source() -> dict[str, object]:
    """Which engine code ran: its directory, and the git commit and local changes there, when it is a checkout."""
    import blink.engine

    path = Path(blink.engine.__file__).resolve().parent
    commit = _git(path, "rev-parse", "HEAD")
    changes = _git(path, "status", "--porcelain", "--", ".") if commit else None
    return {"engine_path": str(path), "git_commit": commit, "engine_modified": bool(changes) if commit else None}


def _git(cwd: Path, *args: str) -> str | None:
    """A read-only git query; --no-optional-locks keeps `status` from rewriting the index."""
    try:
        return subprocess.run(["git", "--no-optional-locks", "-C", str(cwd), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def save(name: str, result: dict, results_dir: Path = RESULTS_DIR) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
