"""Random weights of a checkpoint's shapes, made on the engine's device: vLLM's `--load-format dummy`.

Only config.json (and a tokenizer) need exist, so a benchmark can run the Llama 3 8B shape without downloading or
writing 16 GB. Projections are drawn from N(0, 0.02) as transformers initialises them, norms are ones: the logits
are near flat, so greedy tokens of such a model say little about quality and much about rounding.
"""

from __future__ import annotations

import torch

from blink.engine.model.config import ModelConfig

INIT_STD = 0.02


def tensor_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape of the Hugging Face tensor `name` (one of checkpoint_tensor_names(cfg))."""
    hidden = cfg.hidden_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return cfg.vocab_size, hidden
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (cfg.head_dim,)
    if name.endswith("norm.weight"):
        return (hidden,)
    if name.endswith("shared_expert_gate.weight"):
        return 1, hidden
    inter = cfg.intermediate_size
    if cfg.moe is not None and ".experts." in name:
        inter = cfg.moe.intermediate_size
    elif cfg.moe is not None and ".shared_expert." in name:
        inter = cfg.moe.shared_intermediate_size
    projection = name.split(".")[-2]
    out_in = {"q_proj": (cfg.q_size, hidden), "k_proj": (cfg.kv_size, hidden), "v_proj": (cfg.kv_size, hidden),
              "o_proj": (hidden, cfg.q_size), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter), "w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    if projection == "gate":  # a mixture's router
        return cfg.moe.num_experts, hidden
    shape = out_in[projection]
    return shape[:1] if name.endswith(".bias") else shape


def dummy_tensors(cfg: ModelConfig, names: list[str], device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name in names:
        shape = tensor_shape(cfg, name)
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=cfg.dtype, device=device)
        else:
            tensors[name] = torch.empty(shape, dtype=cfg.dtype, device=device).normal_(0, INIT_STD,
                                                                                         generator=generator)
    return tensors
