"""Rotary position embeddings, with the scalings Llama checkpoints use, as cos/sin tables."""

from __future__ import annotations

import math

import torch

from blink.engine.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_len, head_dim], in the model's dtype (as transformers casts them)."""
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = positions[:, None] * inverse_frequencies(cfg)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, cfg.dtype), emb.sin().to(device, cfg.dtype)


def step_rope(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' rows for a step's tokens, as `rotate` takes them ([tokens, 1, head_dim]): cos, and sin with the
    sign of rotate_half folded in, once per step rather than in every layer."""
    cos, sin = cos[positions], sin[positions]
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in four ops (one roll for rotate_half's two slices, negation and concatenation), with the same
    values: -a * b and a * -b round alike. x: [tokens, heads, head_dim]; cos, signed_sin: from `step_rope`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """As transformers writes it (the reference the kernels are checked against). x: [tokens, heads, head_dim];
    cos/sin: [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
