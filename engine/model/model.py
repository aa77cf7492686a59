"""The decoder shared by Llama, Mistral, Qwen2 and Qwen3 and their mixture-of-experts kin (Mixtral, Qwen2-MoE,
Qwen3-MoE: blink.engine.model.moe), over a ragged batch of tokens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from blink.engine.errors import CheckpointError
from blink.engine.model import kernel_sets, moe
from blink.engine.model.attention import AttentionBatch
from blink.engine.model.checkpoint import load_quantized, load_tensors
from blink.engine.model.config import ModelConfig
from blink.engine.model.dummy import dummy_tensors
from blink.engine.model.kernel_sets import Tokens
from blink.engine.model.linear import OUTPUT, cat, linear, prepare
from blink.engine.model.moe import MoeWeights
from blink.engine.model.parallel import Shard
from blink.engine.model.rope import rope_tables


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections fused: [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    o_proj_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # gate and up projections fused: [2 * intermediate, hidden]; None in a MoE layer
    down: torch.Tensor | None
    moe: MoeWeights | None = None  # the layer's MLP is a mixture of experts
    kv_scales: torch.Tensor | None = None  # float8 KV pages' K and V scales [2] (the pool's; engine/core/kv_dtype.py)


def checkpoint_tensor_names(cfg: ModelConfig) -> list[str]:
    """The Hugging Face names this architecture needs, in the order they are used."""
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
        if cfg.attention_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in ("q", "k", "v")]
        if cfg.o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            names += moe.tensor_names(cfg.moe, i)
        else:
            names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


LOAD_FORMATS = ("auto", "dummy")  # the safetensors; random weights of their shapes (blink.engine.model.dummy)


class Transformer:
    """Weights as plain tensors and a forward pass over [B] tokens that reads and writes the paged cache."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], max_len: int, device: torch.device,
                 shard: Shard | None = None, quantization: str | None = None):
        """cfg and tensors: this rank's part when `shard` is set (Transformer.from_checkpoint cuts them); tensors may
        hold `quant.Quantized` projections (a GGUF's blocks); quantization: int8 or int4 quantizes the float ones."""
        self.cfg, self.shard = cfg, shard
        missing = [n for n in checkpoint_tensor_names(cfg) if n not in tensors]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(f"checkpoint is missing tensor(s): {shown}")

        def get(name: str) -> torch.Tensor:
            return tensors[name].to(device)

        self.embed = get("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            sparse = cfg.moe is not None and cfg.moe.sparse_layers[i]
            self.layers.append(LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=cat([get(attn + f"{n}_proj.weight") for n in ("q", "k", "v")]),
                qkv_bias=torch.cat([get(attn + f"{n}_proj.bias") for n in ("q", "k", "v")])
                if cfg.attention_bias else None,
                q_norm=get(attn + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=get(attn + "k_norm.weight") if cfg.qk_norm else None,
                o_proj=get(attn + "o_proj.weight"),
                o_proj_bias=get(attn + "o_proj.bias") if cfg.o_proj_bias else None,
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=None if sparse else cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                down=None if sparse else get(p + "mlp.down_proj.weight"),
                moe=moe.load(cfg.moe, i, get) if sparse else None,
            ))
        self.norm = get("model.norm.weight")
        tied = cfg.tie_word_embeddings and "lm_head.weight" not in tensors  # a GGUF's blocks may stand in for it
        self.lm_head = self.embed if tied else get("lm_head.weight")
        # On the CPU each projection's weight takes the form its products run fastest in (linear.prepare); a tied
        # output embedding in another layout is a copy, as the lookup reads the plain one.
        for w in self.layers:
            w.qkv, w.o_proj = prepare(w.qkv, quantization), prepare(w.o_proj, quantization)
            if w.moe is None:
                w.gate_up, w.down = prepare(w.gate_up, quantization), prepare(w.down, quantization)
        self.lm_head = prepare(self.lm_head, OUTPUT.get(quantization, quantization))
        if (tied and isinstance(self.lm_head, torch.Tensor) and self.lm_head.layout == torch.strided
                and self.lm_head.dim() == 2):
            self.embed = self.lm_head  # still plain (moved into huge pages, maybe): one copy serves both
        self.cos, self.sin = rope_tables(cfg, max_len, device)
        self.scale = cfg.head_dim ** -0.5
        self.kernels = kernel_sets.choose(cfg, device)
        # Sublayers (attention, MLP) run, ever: progress inside a step, by which the host mode shows the watchdog that
        # a step of seconds (a long prefill of a large model on the CPU) is alive. A Python count: in a captured step
        # it stands still.
        self.sublayers_run = 0

    @classmethod
    def from_checkpoint(cls, model_dir: Path, cfg: ModelConfig, max_len: int, device: torch.device,
                        load_format: str = "auto", shard: Shard | None = None,
                        quantization: str | None = None) -> Transformer:
        """load_format: auto (the safetensors) or dummy (random weights of their shapes, made on `device`); shard:
        this rank's part, with tensor parallelism (blink.engine.model.parallel)."""
        names = checkpoint_tensor_names(cfg)
        if load_format == "dummy":
            tensors = dummy_tensors(cfg, names, device)
        else:
            quantized = load_quantized(model_dir, set(names), cfg.tie_word_embeddings) if quantization == "gguf" else {}
            tensors = load_tensors(model_dir, set(names) - quantized.keys(), cfg.dtype, cfg.fp8) | quantized
        if shard is None:
            return cls(cfg, tensors, max_len, device, quantization=quantization)
        shard.check(cfg)
        return cls(shard.config(cfg), shard.tensors(cfg, tensors), max_len, device, shard, quantization)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [B]; caches: [layers, pages, page_size, kv_heads, head_dim]. Returns [B, hidden]."""
        kernels = self.kernels
        tokens = Tokens(positions, batch, kernels.rope(self.cos, self.sin, positions))
        x = F.embedding(input_ids, self.embed)
        delta = None  # each sublayer's output, added to x by the next norm
        for w, k_layer, v_layer in zip(self.layers, k_cache.unbind(0), v_cache.unbind(0), strict=True):
            x, delta = self.layer(x, delta, w, tokens, k_layer, v_layer)
        return x if delta is None else x + delta

    def layer(self, x: torch.Tensor, delta: torch.Tensor | None, w: LayerWeights, tokens: Tokens,
              k_layer: torch.Tensor, v_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer: the residual stream x (delta, the previous sublayer's output, not yet added) in, the
        stream and this layer's MLP output out (`blink bench step` counts a layer's kernels through this call)."""
        cfg, kernels = self.cfg, self.kernels
        x, h = self._add_norm(x, delta, w.input_norm)
        attn = kernels.attention(linear(h, w.qkv, w.qkv_bias), w, cfg, tokens, k_layer, v_layer, self.scale)
        x, h = self._add_norm(x, self._sum(linear(attn.reshape(-1, cfg.q_size), w.o_proj, w.o_proj_bias)),
                              w.post_norm)
        self.sublayers_run += 1
        if w.moe is not None:
            delta = self._sum(kernels.moe_mlp(h, w.moe, cfg))
        else:
            delta = self._sum(linear(kernels.silu_and_mul(linear(h, w.gate_up)), w.down))
        self.sublayers_run += 1
        return x, delta

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x + delta and its RMSNorm."""
        eps = self.cfg.rms_norm_eps
        return (x, self.kernels.norm(x, weight, eps)) if delta is None else self.kernels.add_norm(x, delta, weight, eps)

    def weight_bytes(self) -> int:
        """The bytes a decode token's forward reads: the layers' weights as held (quantized ones in their codes and
        scales), a mixture's experts as many as a token runs, and the output projection's; the embedding is a row a
        token."""
        total = _held_bytes(self.lm_head)
        for w in self.layers:
            total += _held_bytes(w)
            if w.moe is not None:
                idle = 1 - self.cfg.moe.top_k / self.cfg.moe.num_experts
                total -= idle * (_held_bytes(w.moe.gate_up) + _held_bytes(w.moe.down))
        return int(total)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] rows that sample. Returns float32 logits [R, vocab]."""
        logits = linear(self.kernels.norm(hidden, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()
        return logits if self.shard is None else self.shard.gather_vocab(logits, self.cfg.vocab_size)

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: each rank's partial sum, summed over the ranks."""
        return partial if self.shard is None else self.shard.all_reduce(partial)


def _held_bytes(x: object) -> int:
    """The bytes of the tensors a weight holds, through the dataclasses (LayerWeights, Quantized, ...) it is made of."""
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if dataclasses.is_dataclass(x):
        return sum(_held_bytes(getattr(x, f.name)) for f in dataclasses.fields(x))
    return 0
