"""Where the default model lives, so that tools without the engine (the ingress, `blink bench`) find it."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "blink-tiny-llama-v1"


def default_model_dir() -> Path:
    cache = os.environ.get("BLINK_CACHE_DIR")
    root = Path(cache) if cache else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "blink"
    return root / "models" / DEFAULT_MODEL_NAME
