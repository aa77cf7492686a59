"""A GGUF file converted once into a checkpoint directory in the cache, keyed by the file's content.

The engine asks for the whole checkpoint (dequantized safetensors, in shards of at most 2 GiB, and beside them the
quantized matrices repacked as stored, gguf_blocks.FILE, which `--quantization gguf` runs); an ingress without the
engine's directory asks for the tokenizer's files only, which take a second. Each is written into a staging
directory and renamed into place, so a converter killed halfway leaves nothing that looks complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from blink.shared.checkpoints.errors import CheckpointError
from blink.shared.model_cache import cache_root

SHARD_BYTES = 2 << 30
# The layout a converted directory has; a newer one (2: the repacked quantized matrices; 3: Q6_K among them; 4: Q5_0
# and Q5_1 too) converts the file again.
LAYOUT = 4


def converted(path: Path, weights: bool = True, key: str | None = None, sampling: dict | None = None) -> Path:
    """The checkpoint directory for a GGUF file; key: its content's sha256 when the caller knows it already;
    sampling: defaults for generation_config.json, which GGUF files do not carry (what the model's card recommends)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    key = key or content_key(path)
    done = cached(key, weights)
    if done is not None:
        return done
    target = _directory(key, weights)
    with _one_writer(target):  # tensor-parallel ranks, or an engine and an ingress, starting together
        if cached(key, weights) is None:
            _write(path, target, weights, sampling or {})
    return target


def cached(key: str, weights: bool = True) -> Path | None:
    """The checkpoint directory of the GGUF file with this sha256, when it has been converted (for weights=False,
    its tokenizer's files at least)."""
    if (_directory(key, True) / "config.json").is_file():
        return _directory(key, True)
    tokenizer = _directory(key, False)
    return tokenizer if not weights and (tokenizer / "tokenizer.json").is_file() else None


@contextlib.contextmanager
def _one_writer(target: Path) -> Iterator[None]:
    """An flock beside the target: released by the kernel when its holder dies, so a killed converter blocks no one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _directory(key: str, weights: bool) -> Path:
    return cache_root() / "gguf" / (f"{key[:24]}-{LAYOUT}" if weights else f"{key[:24]}-tokenizer")


def content_key(path: Path) -> str:
    """sha256 of the file, remembered per (path, size, mtime) so that a restart does not read gigabytes again."""
    stat = path.stat()
    memo = cache_root() / "gguf" / "keys" / hashlib.sha256(
        f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    if memo.is_file():
        return memo.read_text().strip()
    with path.open("rb") as f:
        key = hashlib.file_digest(f, "sha256").hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(key)
    return key


def _write(path: Path, target: Path, weights: bool, sampling: dict) -> None:
    from gguf import GGUFReader

    from blink.shared.checkpoints import gguf_config, gguf_tokenizer

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from None
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    gguf_config.hf_architecture(meta)  # refuses an architecture Blink does not run before any work
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        tokenizer_meta = {k.removeprefix("tokenizer.ggml."): v for k, v in meta.items()
                          if k.startswith("tokenizer.ggml.")}
        gguf_tokenizer.build_tokenizer(tokenizer_meta).save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", gguf_config.tokenizer_config(meta))
        _write_json(staging / "generation_config.json", {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
                                                         "eos_token_id": gguf_config.end_token_ids(meta), **sampling})
        if weights:
            _write_weights(reader, meta, staging)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_weights(reader: Any, meta: dict, staging: Path) -> None:
    from safetensors.numpy import save_file
    from tqdm import tqdm

    from blink.shared.checkpoints import gguf_blocks, gguf_config, gguf_weights

    rope_freqs = next((t.data for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    config = gguf_config.hf_config(meta, {t.name for t in reader.tensors}, gguf_weights.stored_dtype(reader.tensors),
                                   rope_freqs)
    shards: list[dict] = [{}]
    sizes = [0]
    tensors = tqdm(reader.tensors, desc=f"converting {Path(reader.data.filename).name}", unit="tensor")
    for name, values in gguf_weights.hf_tensors(tensors, config):
        if sizes[-1] and sizes[-1] + values.nbytes > SHARD_BYTES:
            _save_shard(shards, save_file, staging)
            shards.append({})
            sizes.append(0)
        shards[-1][name] = values
        sizes[-1] += values.nbytes
    _save_shard(shards, save_file, staging)
    quantized, bits = {}, {}
    for name, arrays, width in gguf_weights.hf_quantized(reader.tensors, config):
        quantized.update(zip((f"{name}.codes", f"{name}.scale", f"{name}.offset"), arrays, strict=True))
        bits[name] = width
    if quantized:
        save_file(quantized, str(staging / gguf_blocks.FILE), metadata={"format": "pt",
                                                                      gguf_blocks.BITS_KEY: json.dumps(bits)})
    weight_map = {name: f"model-{i + 1:05d}.safetensors" for i, shard in enumerate(shards) for name in shard}
    _write_json(staging / "model.safetensors.index.json", {"metadata": {"total_size": sum(sizes)},
                                                             "weight_map": weight_map})
    _write_json(staging / "config.json", config)


def _save_shard(shards: list[dict], save_file: Any, staging: Path) -> None:
    """Writes the newest shard and drops its arrays (a large model is never held whole)."""
    save_file(shards[-1], str(staging / f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
    shards[-1] = dict.fromkeys(shards[-1])


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
