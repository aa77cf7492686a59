"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): the checkpoint's expert tensors stacked at load, and
the layer's computation.

Routing is transformers': a softmax over the router's logits in float32, the top_k experts of each token, their
weights renormalised to 1 where the checkpoint says, then cast to the model's dtype. The tokens' copies are sorted
by expert (stably, so each token's experts add up in expert order, as transformers adds them), and each expert that
any token chose runs one product over its rows: the work grows with the routed tokens and the experts they touch,
not with experts × tokens. Which experts those are is read on the host, so this path runs in the `host` drive
mode; the captured step needs a grouped kernel over a fixed-size sorted buffer, which is not built yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blink.engine.model.config import MoeConfig
from blink.engine.model.linear import linear

_EXPERT_NAMES = {"mixtral": ("block_sparse_moe.", "w1", "w3", "w2"), "qwen": ("mlp.", "gate_proj", "up_proj",
                                                                             "down_proj")}


@dataclass
class MoeWeights:
    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 * intermediate, hidden]: each expert's gate and up projections fused
    down: torch.Tensor  # [experts, hidden, intermediate]
    shared_gate_up: torch.Tensor | None = None  # Qwen2-MoE's shared expert
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]: the sigmoid gate of the shared expert's output


def tensor_names(moe: MoeConfig, layer: int) -> list[str]:
    """The Hugging Face names of one MoE layer's MLP tensors."""
    prefix, gate, up, down = _EXPERT_NAMES[moe.naming]
    p = f"model.layers.{layer}.{prefix}"
    names = [p + "gate.weight"]
    for e in range(moe.num_experts):
        names += [f"{p}experts.{e}.{n}.weight" for n in (gate, up, down)]
    if moe.shared_intermediate_size:
        names += [f"{p}shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")]
        names.append(p + "shared_expert_gate.weight")
    return names


def load(moe: MoeConfig, layer: int, get: Callable[[str], torch.Tensor]) -> MoeWeights:
    """Stacks one layer's experts, so the layer indexes them rather than holding a Python object per expert."""
    prefix, gate, up, down = _EXPERT_NAMES[moe.naming]
    p = f"model.layers.{layer}.{prefix}"
    experts = range(moe.num_experts)
    weights = MoeWeights(
        router=get(p + "gate.weight"),
        gate_up=torch.stack([torch.cat([get(f"{p}experts.{e}.{gate}.weight"), get(f"{p}experts.{e}.{up}.weight")])
                             for e in experts]),
        down=torch.stack([get(f"{p}experts.{e}.{down}.weight") for e in experts]),
    )
    if moe.shared_intermediate_size:
        s = p + "shared_expert."
        weights.shared_gate_up = torch.cat([get(s + "gate_proj.weight"), get(s + "up_proj.weight")])
        weights.shared_down = get(s + "down_proj.weight")
        weights.shared_gate = get(p + "shared_expert_gate.weight")
    return weights


def _mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


def moe_mlp(h: torch.Tensor, w: MoeWeights, moe: MoeConfig) -> torch.Tensor:
    """h: [B, hidden] -> [B, hidden]."""
    probs = linear(h, w.router).float().softmax(-1)
    weights, experts = probs.topk(moe.top_k, dim=-1)  # [B, k]
    if moe.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(h.dtype)
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    token = order // moe.top_k
    rows = h[token]  # each token once per expert it chose, grouped by expert
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()  # the host's read: which experts run
    outputs = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            outputs[start:start + n] = _mlp(rows[start:start + n], w.gate_up[expert], w.down[expert])
            start += n
    out = torch.zeros_like(h).index_add_(0, token, outputs * weights.flatten()[order][:, None])
    if w.shared_gate_up is not None:
        out += torch.sigmoid(linear(h, w.shared_gate)) * _mlp(h, w.shared_gate_up, w.shared_down)
    return out
