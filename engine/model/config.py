"""The architecture description read from a checkpoint's config.json (and its FP8 format, where it has one)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from blink.engine.errors import CheckpointError
from blink.engine.model.fp8 import Fp8Scheme, scheme

# Architectures that share one decoder; they differ in which optional tensors exist, and the mixture-of-experts
# ones in their MLPs (MoeConfig). The family names the attention's details.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
}
MOE_NAMING = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen", "Qwen3MoeForCausalLM": "qwen"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token goes to the top_k of num_experts experts (softmax over the router's
    logits), their outputs summed by the routing weights (renormalised to 1 when `normalize`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    normalize: bool
    sparse_layers: tuple[bool, ...]  # which layers' MLP is the mixture (the others are dense)
    naming: str  # mixtral (block_sparse_moe.experts.E.w1/w3/w2) | qwen (mlp.experts.E.gate/up/down_proj)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert, gated by a sigmoid (0: none)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v projections carry biases
    o_proj_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: torch.dtype
    moe: MoeConfig | None = None
    fp8: Fp8Scheme | None = None  # the checkpoint's weights are FP8, stored as this scheme says

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: missing config.json")
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or '(none given)'}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        # FP8 is the one quantized format read from a checkpoint (blink.engine.model.fp8); others are refused by name
        quantization = cfg.get("quantization_config") or cfg.get("compression_config")
        fp8_scheme = scheme(quantization, source) if quantization else None
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r}; supported: silu")
        if cfg.get("mlp_bias", False):
            raise CheckpointError(f"{source}: mlp_bias=true is not supported")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if dtype_name not in DTYPES:
            raise CheckpointError(f"{source}: unsupported dtype {dtype_name!r}; supported: {', '.join(DTYPES)}")
        # Mistral and Qwen2 carry a sliding window; Qwen2 only uses it when use_sliding_window is set.
        window = cfg.get("sliding_window")
        if family in ("qwen2", "qwen3"):
            if cfg.get("use_sliding_window", False):
                # Qwen slides only some layers (max_window_layers / layer_types); not supported yet.
                raise CheckpointError(f"{source}: use_sliding_window=true is not supported for {arch}")
            window = None
        return cls(
            architecture=arch,
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg, source),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or cfg.get("attention_bias", False),
            o_proj_bias=family != "qwen2" and cfg.get("attention_bias", False),
            qk_norm=family == "qwen3",
            sliding_window=window,
            dtype=DTYPES[dtype_name],
            moe=_moe(arch, cfg, source),
            fp8=fp8_scheme,
        )


def _moe(arch: str, cfg: dict, source: str) -> MoeConfig | None:
    naming = MOE_NAMING.get(arch)
    if naming is None:
        return None
    layers = cfg["num_hidden_layers"]
    if naming == "mixtral":  # every layer, top-k weights always renormalised
        return MoeConfig(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], True,
                         (True,) * layers, naming)
    # The hub's Qwen MoE configs say num_experts; transformers 5 writes num_local_experts.
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
    if not 0 < cfg["num_experts_per_tok"] <= max(experts, 1):
        raise CheckpointError(f"{source}: num_experts_per_tok {cfg['num_experts_per_tok']} of {experts} experts")
    return MoeConfig(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                     bool(cfg.get("norm_topk_prob", False)), sparse, naming,
                     cfg.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0)


def _rope_params(cfg: dict) -> dict:
    # transformers 5 folds rope_theta and rope_scaling into `rope_parameters`.
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_theta(cfg: dict) -> float:
    return float(cfg.get("rope_theta") or _rope_params(cfg).get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict, source: str) -> RopeScaling:
    params = _rope_params(cfg)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise CheckpointError(f"{source}: unsupported rope scaling {kind!r}; supported: default, linear, llama3")
