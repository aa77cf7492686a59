"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): the checkpoint's expert tensors stacked at load, and
the layer's computation.

Routing is transformers': a softmax over the router's logits in float32, the top_k experts of each token, their
weights renormalised to 1 where the checkpoint says, then cast to the model's dtype. The tokens' copies are sorted
by expert (stably, so each token's experts add up in expert order, as transformers adds them). Two ways to run
the experts, both with work that grows with the routed tokens, not with experts × tokens:

- `moe_mlp` (the torch kernels: the CPU): one product per expert any token chose, over its rows; which experts
  those are is read on the host.
- `grouped_moe_mlp` (the Triton kernels: CUDA, and the device step): the copies sorted into a buffer of a size
  fixed by the batch (tokens × top_k + experts × (BLOCK_M − 1)), each expert's rows padded to whole blocks, and one
  grouped kernel per projection over the blocks (blink.engine.kernels.moe): no host read, no shape that depends on
  the routing, so the captured step holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blink.engine.model import huge_pages
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
    """Stacks one layer's experts, so the layer indexes them rather than holding a Python object per expert (on the
    CPU in huge pages: blink.engine.model.huge_pages)."""
    prefix, gate, up, down = _EXPERT_NAMES[moe.naming]
    p = f"model.layers.{layer}.{prefix}"
    experts = range(moe.num_experts)
    weights = MoeWeights(
        router=get(p + "gate.weight"),
        gate_up=huge_pages.moved(torch.stack([torch.cat([get(f"{p}experts.{e}.{gate}.weight"),
                                                         get(f"{p}experts.{e}.{up}.weight")]) for e in experts])),
        down=huge_pages.moved(torch.stack([get(f"{p}experts.{e}.{down}.weight") for e in experts])),
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


def route(h: torch.Tensor, w: MoeWeights, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts [B, k] and their weights [B, k], in h's dtype."""
    probs = linear(h, w.router).float().softmax(-1)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    if moe.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(h.dtype), experts


def moe_mlp(h: torch.Tensor, w: MoeWeights, moe: MoeConfig) -> torch.Tensor:
    """h: [B, hidden] -> [B, hidden]."""
    weights, experts = route(h, w, moe)
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
    return _add_shared_expert(out, h, w)


def _add_shared_expert(out: torch.Tensor, h: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    if w.shared_gate_up is not None:
        out += torch.sigmoid(linear(h, w.shared_gate)) * _mlp(h, w.shared_gate_up, w.shared_down)
    return out


@dataclass
class SortedCopies:
    """Each token's copies (one per expert it chose) sorted by expert into rows of a fixed-size buffer."""

    token: torch.Tensor  # [rows] the token each row copies (padding rows: 0, never read back)
    block_expert: torch.Tensor  # [rows // block] the expert of each block of rows; -1: unused
    rows_of: torch.Tensor  # [B, k] each token's rows, in the order of its experts' ids


def buffer_rows(tokens: int, top_k: int, experts: int, block: int) -> int:
    """The bound on the sorted buffer: every copy, plus each expert's padding to whole blocks."""
    return -(-(tokens * top_k + experts * (block - 1)) // block) * block


def sort_by_expert(experts: torch.Tensor, num_experts: int, block: int) -> SortedCopies:
    """experts: [B, k], each token's experts in increasing id order. Tensor ops of fixed shapes only."""
    tokens, k = experts.shape
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                          torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    by_expert = flat[order]
    # A copy's row: its expert's padded start, plus its rank among that expert's copies.
    row = (ends - padded)[by_expert] + torch.arange(flat.shape[0], device=flat.device) - (counts.cumsum(0) - counts)[
        by_expert]
    rows = buffer_rows(tokens, k, num_experts, block)
    token = torch.zeros(rows, dtype=torch.int64, device=flat.device).scatter_(0, row, order // k)
    rows_of = torch.empty_like(row).scatter_(0, order, row).view(tokens, k)
    starts = torch.arange(0, rows, block, device=flat.device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    return SortedCopies(token, torch.where(block_expert < num_experts, block_expert, -1), rows_of)


def grouped_moe_mlp(h: torch.Tensor, w: MoeWeights, moe: MoeConfig, kernels) -> torch.Tensor:
    """moe_mlp with no host read: the copies sorted into a fixed-size buffer and each projection one grouped
    kernel over it (kernels: blink.engine.kernels.moe). Each token's outputs add up in its experts' id order, as
    moe_mlp's do."""
    weights, experts = route(h, w, moe)
    experts, within = experts.sort(dim=-1)
    weights = weights.gather(1, within)
    copies = sort_by_expert(experts, moe.num_experts, kernels.BLOCK_M)
    outputs = kernels.expert_products(h, copies.token, copies.block_expert, w.gate_up, w.down)
    out = torch.zeros_like(h)
    for j in range(moe.top_k):  # one at a time, in expert order: moe_mlp's sums, rounded the same
        out = out + outputs[copies.rows_of[:, j]] * weights[:, j, None]
    return _add_shared_expert(out, h, w)
