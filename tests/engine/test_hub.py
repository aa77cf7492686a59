"""Models named by a Hub id, resolved offline from a cache in the Hub's own layout (HF_HOME, HF_HUB_OFFLINE)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from blink.engine.model.tiny_model import ensure_tiny_model

REPO = "blink-tests/tiny-llama"


def _cache(hf_home: Path, repo: str, source: Path, revision: str = "main", commit: str = "a" * 40) -> Path:
    """A snapshot of `source`'s files as huggingface_hub lays one out: blobs, a snapshot of links, a ref."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for file in source.iterdir():
        blob = root / "blobs" / f"{commit[:8]}-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return snapshot


def _blink(hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "blink.services.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_a_hub_id_loads_from_the_cache_offline(tmp_path):
    snapshot = _cache(tmp_path, REPO, ensure_tiny_model())
    pulled = _blink(tmp_path, "model", "pull", REPO)
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()) == snapshot
    generated = _blink(tmp_path, "generate", "--model", REPO, "Hello", "--max-tokens", "3")
    assert generated.returncode == 0, generated.stderr
    assert '"tokens": 3' in generated.stdout


def test_a_revision_picks_its_snapshot(tmp_path):
    _cache(tmp_path, REPO, ensure_tiny_model())
    tagged = _cache(tmp_path, REPO, ensure_tiny_model(), revision="v1", commit="b" * 40)
    pulled = _blink(tmp_path, "model", "pull", REPO, "--revision", "v1")
    assert Path(pulled.stdout.strip()) == tagged, pulled.stderr


def test_a_model_neither_here_nor_cached_is_refused_with_the_reason(tmp_path):
    pulled = _blink(tmp_path, "model", "pull", "blink-tests/absent")
    assert pulled.returncode == 1
    assert "not in the local Hub cache" in pulled.stderr
    assert "Traceback" not in pulled.stderr


def test_a_quantized_hub_model_is_refused_before_its_weights_are_fetched(tmp_path):
    """Only config and tokenizer are cached: were the weights fetched first, this would fail on those instead."""
    small = tmp_path / "small"
    small.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_tiny_model() / name, small / name)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    _cache(tmp_path / "hf", REPO, small)
    pulled = _blink(tmp_path / "hf", "model", "pull", REPO)
    assert pulled.returncode == 1
    assert "Blink cannot load awq checkpoints yet" in pulled.stderr
