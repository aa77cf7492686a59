"""`--model` resolved to a checkpoint directory: what every service and the offline API call.

A model is named as vLLM takes it: a checkpoint directory, a `.gguf` file, or a Hub id (`Qwen/Qwen3-8B`); nothing
names the default model. Local paths win over Hub ids, as in vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from blink.shared.checkpoints import default_model, gguf_file, hub
from blink.shared.checkpoints.errors import CheckpointError

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # a directory in Hugging Face's layout
    name: str  # the model's name when --served-model-name gives none


def resolve(model: str | None, weights: bool = True, revision: str | None = None,
            check: Callable[[Path], object] | None = None) -> Checkpoint:
    """weights=False: only the tokenizer's files are needed (an ingress); check: run on a Hub model's config before
    its weights are fetched (the engine passes its config loader, which refuses what it cannot run)."""
    if model is None:  # once converted, the GGUF file is not needed (nor fetched) again
        key = default_model.SHA256
        path = gguf_file.cached(key, weights) or gguf_file.converted(default_model.gguf_path(), weights, key=key,
                                                                     sampling=default_model.SAMPLING)
        return Checkpoint(path, default_model.NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        return Checkpoint(path, path.name)
    if path.suffix == ".gguf":
        return Checkpoint(gguf_file.converted(path, weights), path.stem)
    if path.exists():
        raise CheckpointError(f"{model}: neither a checkpoint directory nor a .gguf file")
    if _HUB_ID.fullmatch(model):
        return Checkpoint(hub.snapshot(model, revision, weights, check), model)
    raise CheckpointError(f"{model}: no such file or directory, and not a Hub id (ORGANIZATION/NAME)")
