"""Tensor parallelism, Megatron's split: ranks are processes joined by torch.distributed (gloo on the CPU, NCCL on
GPUs), each holding a slice of every layer.

- Attention by heads: a rank holds num_heads / world query heads and the KV heads they read (num_kv_heads / world
  of them, or, with fewer KV heads than ranks, the one its query heads share, replicated); its KV cache holds only
  those. The output projection's input columns follow the query heads, and its partial sums are all-reduced.
- The MLP by its intermediate size: gate and up rows, down columns, the down projection's sums all-reduced. A
  mixture of experts likewise, expert by expert (and its shared expert): every rank routes every token alike with
  the whole router, computes its slice of each chosen expert, and the weighted sums are all-reduced once.
- The output embedding by vocabulary rows; the logits are gathered, so every rank samples the same tokens from the
  same logits (the counter-based noise needs no shared random state). The input embedding is replicated.

Every rank runs the same step on the same state: the scheduler's decisions are tensor code, and the few host
inputs that are not (the clock, the step-cost fit, the admitted records) come from rank 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from blink.engine.model.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def check(self, cfg: ModelConfig) -> None:
        sizes = [("num_attention_heads", cfg.num_heads)]
        if cfg.moe is None or not all(cfg.moe.sparse_layers):
            sizes.append(("intermediate_size", cfg.intermediate_size))
        if cfg.moe is not None:
            sizes += [("the experts' intermediate size", cfg.moe.intermediate_size),
                      ("shared_expert_intermediate_size", cfg.moe.shared_intermediate_size)]
        for name, value in sizes:
            if value % self.world:
                raise ValueError(f"{name} {value} does not split over {self.world} ranks")
        kv = cfg.num_kv_heads
        if kv % self.world and self.world % kv:
            raise ValueError(f"num_key_value_heads {kv} neither splits over nor divides {self.world} ranks")

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The slice of the model this rank computes."""
        moe = cfg.moe and dataclasses.replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // self.world,
                                              shared_intermediate_size=cfg.moe.shared_intermediate_size // self.world)
        # Untied: a rank's output embedding is its rows of the vocabulary, not its whole input embedding.
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // self.world,
                                   num_kv_heads=max(1, cfg.num_kv_heads // self.world),
                                   intermediate_size=cfg.intermediate_size // self.world, tie_word_embeddings=False,
                                   moe=moe)

    def tensors(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of each checkpoint tensor (cfg: the whole model's)."""
        local = self.config(cfg)
        d, q_heads = cfg.head_dim, local.num_heads
        q_rows = self._rows(q_heads * d)
        first_kv = self.rank * q_heads // (cfg.num_heads // cfg.num_kv_heads)  # the KV head its first query reads
        kv_rows = slice(first_kv * d, (first_kv + local.num_kv_heads) * d)
        vocab = -(-cfg.vocab_size // self.world)
        out = {}
        for name, t in tensors.items():
            part = name.rsplit(".", 2)[-2]
            mlp_rows = self._rows(_mlp_width(local, name))
            if part == "q_proj":
                t = t[q_rows]
            elif part in ("k_proj", "v_proj"):
                t = t[kv_rows]
            elif part == "o_proj" and name.endswith("weight"):
                t = t[:, q_rows]
            elif part == "o_proj":  # its bias counts once in the sum over ranks: rank 0's
                t = t if self.rank == 0 else torch.zeros_like(t)
            elif part in ("gate_proj", "up_proj", "w1", "w3"):
                t = t[mlp_rows]
            elif part in ("down_proj", "w2"):
                t = t[:, mlp_rows]
            elif name == "lm_head.weight":
                t = _vocab_rows(t, self.rank, vocab)
            out[name] = t.contiguous()
        if cfg.tie_word_embeddings:  # the output embedding is the input one's rows; the input one stays whole
            out["lm_head.weight"] = _vocab_rows(tensors["model.embed_tokens.weight"], self.rank, vocab).contiguous()
        return out

    def _rows(self, width: int) -> slice:
        """This rank's part of a dimension `width` per rank."""
        return slice(self.rank * width, (self.rank + 1) * width)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """[rows, vocab / world] on each rank -> [rows, vocab] on every rank."""
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=1)[:, :vocab]

    def smallest(self, n: int, device: torch.device) -> int:
        """The smallest of every rank's `n`."""
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t[0])

    def from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place: the host inputs every rank must agree on."""
        dist.broadcast(x, src=0)
        return x


def _mlp_width(local: ModelConfig, name: str) -> int:
    """A rank's intermediate size for the MLP tensor `name`: a dense MLP's, an expert's or the shared expert's."""
    if ".shared_expert." in name:
        return local.moe.shared_intermediate_size
    if ".experts." in name:
        return local.moe.intermediate_size
    return local.intermediate_size


def _vocab_rows(weight: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    """This rank's `rows` of the vocabulary, the last rank's padded with zero rows (their logits are cut off)."""
    part = weight[rank * rows:(rank + 1) * rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], weight.shape[1])])
    return part
