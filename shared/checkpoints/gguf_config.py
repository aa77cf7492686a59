"""A GGUF file's metadata as the JSON files of a Hugging Face checkpoint: config.json, generation_config.json and
tokenizer_config.json.

GGUF names architectures and hyperparameters in llama.cpp's terms (`llama.block_count`); this maps the ones Blink
runs to transformers' names, and refuses the rest by name.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from blink.shared.checkpoints.errors import CheckpointError

# general.architecture -> (config.json's architectures[0], model_type); a llama file with experts is Mixtral.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")
# llama.cpp writes Llama 3.1's rope scaling as per-frequency factors (rope_freqs); these are the parameters every
# Llama 3.x release used, recovered by checking that they give the file's factors.
_LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def hf_architecture(meta: dict[str, Any]) -> tuple[str, str]:
    arch = meta["general.architecture"]
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    if arch == "llama" and meta.get("llama.expert_count", 0):
        return MIXTRAL
    return ARCHITECTURES[arch]


def hf_config(meta: dict[str, Any], tensor_names: set[str], dtype: str,
              rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """config.json for the file; tensor_names tells which optional tensors (biases, a separate lm_head) it has."""
    architecture, model_type = hf_architecture(meta)
    a = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{a}.{key}", default)
        # GGUF stores floats in 32 bits: written back as the shortest decimal that reads as the same float32 (1e-06)
        return float(str(np.float32(value))) if isinstance(value, float) else value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    config: dict[str, Any] = dict(
        architectures=[architecture], model_type=model_type, torch_dtype=dtype, hidden_act="silu",
        vocab_size=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden, intermediate_size=get("feed_forward_length"), num_hidden_layers=get("block_count"),
        num_attention_heads=heads, num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length", hidden // heads),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6), rope_theta=get("rope.freq_base", 10000.0),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
    if get("attention.sliding_window"):
        config["sliding_window"] = get("attention.sliding_window")
    if scaling := _rope_scaling(get, config, rope_freqs):
        config["rope_scaling"] = scaling
    if get("expert_count", 0):
        config |= _experts(get, model_type)
    return config


def _rope_scaling(get, config: dict, rope_freqs: np.ndarray | None) -> dict | None:
    kind = get("rope.scaling.type", "none")
    if rope_freqs is not None:
        return _llama3_scaling(rope_freqs, config)
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    raise CheckpointError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, llama3")


def _llama3_scaling(rope_freqs: np.ndarray, config: dict) -> dict:
    factor = float(rope_freqs.max())
    dim = config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    p = _LLAMA3_ROPE
    wavelen = 2 * math.pi / inv_freq
    smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
        p["high_freq_factor"] - p["low_freq_factor"])
    expected = np.where(wavelen < p["original_max_position_embeddings"] / p["high_freq_factor"], 1.0,
                        np.where(wavelen > p["original_max_position_embeddings"] / p["low_freq_factor"], factor,
                                 1 / ((1 - smooth) / factor + smooth)))
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-3):
        raise CheckpointError("GGUF rope_freqs are not Llama 3's scaling with its usual parameters; other per-"
                              "frequency rope factors are not supported")
    return {"rope_type": "llama3", "factor": factor, **p}


def _experts(get, model_type: str) -> dict:
    experts, top_k = get("expert_count"), get("expert_used_count")
    if model_type == "mixtral":
        return dict(num_local_experts=experts, num_experts_per_tok=top_k)
    fields = dict(num_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=get("expert_feed_forward_length"), decoder_sparse_step=1, mlp_only_layers=[],
                  # Qwen3-MoE renormalises its top-k weights, Qwen2-MoE does not (their configs' norm_topk_prob)
                  norm_topk_prob=bool(get("expert_weights_norm", model_type == "qwen3_moe")))
    if model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length", 0)
    return fields


def end_token_ids(meta: dict[str, Any]) -> list[int]:
    """eos, and the end-of-turn / end-of-message tokens llama.cpp also stops at."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[{"unknown": "unk_token", "padding": "pad_token"}.get(name, f"{name}_token")] = tokens[token_id]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    context = meta.get(f"{meta['general.architecture']}.context_length")
    if context:
        config["model_max_length"] = context
    return config
