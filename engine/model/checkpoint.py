"""Load a Hugging Face checkpoint directory as it is: config, safetensors shards (an FP8 checkpoint's projections
with their scales), generation config; and a converted GGUF's quantized matrices as the file stored them
(`load_quantized`)."""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from blink.engine.errors import CheckpointError
from blink.engine.model import fp8
from blink.engine.model.config import ModelConfig
from blink.engine.model.quant import Quantized
from blink.shared.checkpoints import gguf_blocks


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    return files


# safetensors' names of the types a weight may be stored in: any other (I8, U8, F8_E4M3 outside an FP8 checkpoint) is
# a quantized weight that a cast would turn into wrong numbers, whatever config.json says.
FLOAT_TYPES = {"F32", "BF16", "F16"}
# The dense projections a model runs as `linear` products: an FP8 checkpoint's stay FP8 (blink.engine.model.fp8),
# its other FP8 tensors (experts, an output projection) are dequantized to the float dtype on load.
FP8_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def load_tensors(model_dir: Path, wanted: set[str], dtype: torch.dtype,
                 fp8_scheme: fp8.Fp8Scheme | None = None) -> dict[str, torch.Tensor | fp8.Fp8Weight]:
    """Reads the wanted tensors from every shard, cast to dtype; other tensors are left on disk. fp8_scheme: the
    checkpoint's FP8 format (ModelConfig.fp8), whose projections come as `fp8.Fp8Weight`s with their scales."""
    files = safetensors_files(model_dir)
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    tensors: dict[str, torch.Tensor | fp8.Fp8Weight] = {}
    with ExitStack() as stack:
        opened = {file: stack.enter_context(safe_open(str(file), framework="pt")) for file in files}

        def get(name: str) -> torch.Tensor:
            return opened[where[name]].get_tensor(name)

        for name in sorted(wanted & where.keys()):
            file = where[name]
            stored = opened[file].get_slice(name).get_dtype()
            if stored == fp8.STORED and fp8_scheme is not None:
                weight = fp8.read(get, name, where.__contains__, fp8_scheme, dtype, f"{file}")
                tensors[name] = weight if FP8_PROJECTION.fullmatch(name) else weight.dequantize()
            elif stored not in FLOAT_TYPES:
                raise CheckpointError(f"{file}: {name} is stored as {stored}, a quantized type Blink does not "
                                      f"load here (it loads {', '.join(sorted(FLOAT_TYPES))}, and F8_E4M3 where "
                                      "config.json's quantization_config says FP8)")
            else:
                tensors[name] = get(name).to(dtype)
    return tensors


def load_quantized(model_dir: Path, wanted: set[str], tied: bool) -> dict[str, Quantized]:
    """The wanted matrices a GGUF file stored in a type Blink runs as it is (blink.shared.checkpoints.gguf_blocks),
    for `--quantization gguf`; tied: the embedding's blocks serve as the output projection, `lm_head.weight`. The
    embedding's lookup reads floats, so its own blocks are never among them."""
    path = model_dir / gguf_blocks.FILE
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: --quantization gguf runs the quantized blocks of a GGUF file (--model "
                              "FILE.gguf); this checkpoint has none (safetensors: --quantization int8 or int4 "
                              "quantizes them on load)")
    out: dict[str, Quantized] = {}
    with safe_open(str(path), framework="pt") as f:
        for name, bits in json.loads(f.metadata()[gguf_blocks.BITS_KEY]).items():
            target = "lm_head.weight" if tied and name == "model.embed_tokens.weight" else name
            if target != "model.embed_tokens.weight" and (target in wanted or (tied and target == "lm_head.weight")):
                out[target] = Quantized(*(f.get_tensor(f"{name}.{part}") for part in ("codes", "scale", "offset")),
                                        bits)
    return out


def read_generation_defaults(model_dir: Path) -> GenerationDefaults:
    """eos ids from generation_config.json, falling back to config.json, as transformers does."""
    eos: list[int] = []
    bos = None
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        cfg = json.loads(path.read_text())
        value = cfg.get("eos_token_id")
        if value is not None and not eos:
            eos = [value] if isinstance(value, int) else list(value)
        if bos is None:
            bos = cfg.get("bos_token_id")
    return GenerationDefaults(eos_token_ids=tuple(eos), bos_token_id=bos)


def load_config(model_dir: Path) -> ModelConfig:
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a checkpoint directory")
    return ModelConfig.from_dir(model_dir)
