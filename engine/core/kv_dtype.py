"""How KV pages are stored (`--kv-cache-dtype`, vLLM's flag): the model's dtype, or FP8 with a scale per layer.

An FP8 page holds `round(x / scale)` in float8 (E4M3 for `fp8` / `fp8_e4m3`, E5M2 for `fp8_e5m2`): the Triton
attention launch quantizes K and V as it writes them and multiplies by the scale as it reads them
(blink.engine.kernels.attention). The scales are per layer, one for K and one for V, as vLLM's: the checkpoint's
`self_attn.k_scale` / `v_scale` (or one `kv_scale` for both) where an FP8 checkpoint carries them, else 1.0.
Only the Triton kernels read FP8 pages: the C++ CPU kernels and the torch reference are refused the flag at start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from blink.shared.settings import KV_CACHE_DTYPES

STORAGE = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
assert set(STORAGE) | {"auto"} == set(KV_CACHE_DTYPES)
# Names the checkpoint's scales go by (vLLM's, then the older AutoFP8 `kv_scale` and per-projection output scales).
SCALE_NAMES = (("self_attn.k_scale", "self_attn.v_scale"), ("self_attn.kv_scale", "self_attn.kv_scale"),
               ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"))


def storage(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype KV pages are stored in."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return STORAGE.get(kv_cache_dtype, model_dtype)


def check(kv_cache_dtype: str, device: torch.device) -> None:
    """Refuses FP8 pages where the kernels that would run cannot read them (before the model loads): the Triton
    kernels run on CUDA (8.9+: float8 conversions) unless BLINK_KERNELS names another set, and on the CPU only when
    it names triton (the interpreter)."""
    if kv_cache_dtype == "auto":
        return
    chosen = os.environ.get("BLINK_KERNELS")
    if device.type == "cuda" and chosen in (None, "triton"):
        if torch.cuda.get_device_capability(device) < (8, 9):  # Triton converts to float8 from Ada/Hopper on
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} needs a GPU of compute capability 8.9+ (float8 "
                             f"conversions), not {torch.cuda.get_device_name(device)}")
        return
    if chosen == "triton":
        return
    runs = chosen or "the C++ CPU kernels or the torch reference"
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} stores KV pages in FP8, which only the Triton kernels read: "
                     f"it needs a GPU (or BLINK_KERNELS=triton, Triton's interpreter on the CPU, for tests); "
                     f"here {runs} would run on {device.type}")


def checkpoint_scales(model_dir: Path | None, num_layers: int) -> torch.Tensor:
    """[layers, 2] float32: each layer's K and V scale, read from the checkpoint's safetensors where it has them
    (a layer without them, or a checkpoint without any: 1.0)."""
    scales = torch.ones(num_layers, 2, dtype=torch.float32)
    files = _safetensors(model_dir) if model_dir is not None else []
    if not files:
        return scales
    from safetensors import safe_open

    wanted = {f"model.layers.{i}.{name}": (i, j) for i in range(num_layers)
              for pair in SCALE_NAMES for j, name in enumerate(pair)}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if key in wanted:
                    i, j = wanted[key]
                    value = f.get_tensor(key).float()
                    # vLLM takes one number a layer: a per-head or per-channel scale is folded to its largest.
                    scales[i, j] = value.max() if value.numel() else 1.0
                    if key.endswith("kv_scale"):
                        scales[i, 1 - j] = scales[i, j]
    if not torch.isfinite(scales).all() or (scales <= 0).any():
        raise ValueError(f"{model_dir}: the checkpoint's KV cache scales must be finite and positive")
    return scales


def _safetensors(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():  # a .gguf file: no scales
        return []
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(model_dir.glob("*.safetensors"))
