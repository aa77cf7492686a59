"""Where Blink keeps what it makes once per machine: models fetched and converted (blink.shared.checkpoints), the
tiny random model for tests and benchmarks (found there by tools without the engine: `blink bench`), the CPU
kernels' build, llama.cpp for `blink bench cpu`."""

from __future__ import annotations

import os
from pathlib import Path

TINY_MODEL_NAME = "blink-tiny-llama-v1"


def cache_root() -> Path:
    """$BLINK_CACHE_DIR, else $XDG_CACHE_HOME/blink, else ~/.cache/blink."""
    cache = os.environ.get("BLINK_CACHE_DIR")
    return Path(cache) if cache else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "blink"


def tiny_model_dir() -> Path:
    return cache_root() / "models" / TINY_MODEL_NAME
