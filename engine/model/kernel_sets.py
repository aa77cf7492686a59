"""What runs the forward's work besides the projections, and samples: torch ops or Triton kernels.

`TorchKernels` is the reference: plain torch ops on any device, with the torch sampler. Its mixture-of-experts
layer reads on the host which experts run, so a device mode cannot capture it.
`CpuKernels` is the CPU's choice: the reference with its chains of small ops, each a few microseconds of dispatch
there, fused in C++ (blink.engine.kernels.cpu: norms, RoPE written into the cache, one-query attention straight from
the pages, a step's attention from the projection's output in one call, prefill tokens as one-query rows too, the
MLP's activation in one; and the step's bookkeeping, engine/kernels/cpu_*.py).
`TritonKernels` is CUDA's: fused norms, one launch a layer for RoPE, the cache write and paged attention over row
lists the kernels read on the device, SiLU x up fused, grouped experts and the fused sampler; without CUDA it runs in
Triton's interpreter (the tests check it against the reference that way). A new backend is a class with these
methods, named in `KERNEL_SETS`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from blink.engine.core.bookkeeping import TORCH_BOOKKEEPING, Bookkeeping
from blink.engine.core.sampler import TORCH_SAMPLER, Sampler
from blink.engine.core.scheduler import QUERY_BLOCK, PlanKernels, QueryRows, StepPlan
from blink.engine.model import moe
from blink.engine.model.attention import AttentionBatch, build_row_group, paged_attention
from blink.engine.model.config import ModelConfig
from blink.engine.model.rope import rotate, step_rope

if TYPE_CHECKING:
    from blink.engine.core.step import StepShape
    from blink.engine.model.model import LayerWeights
    from blink.engine.model.moe import MoeWeights

log = logging.getLogger(__name__)


@dataclass
class Tokens:
    """One forward's tokens as every layer's attention reads them."""

    positions: torch.Tensor  # [B]
    batch: AttentionBatch
    rope: tuple[torch.Tensor, ...]  # what the backend's attention rotates with (its `rope` makes it)


class KernelSet(Protocol):
    name: str
    sampler: Sampler
    bookkeeping: Bookkeeping  # engine/core/bookkeeping.py
    # A mixture-of-experts layer with no host read, so the device modes can capture it.
    moe_captures: bool

    def attention_batch(self, plan: StepPlan, shape: StepShape, block_table: torch.Tensor,
                        page_size: int) -> AttentionBatch: ...

    def decode_batch(self, rows: QueryRows, block_table: torch.Tensor, page_size: int,
                     context: int) -> AttentionBatch:
        """A forward outside the plan's layout (a draft model's tokens): batch token i is row i's one query, the
        first `rows.count` real; context: cache rows a row may read (the step's bucket)."""
        ...

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def attention(self, qkv: torch.Tensor, w: LayerWeights, cfg: ModelConfig, tokens: Tokens, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, scale: float) -> torch.Tensor: ...

    def moe_mlp(self, h: torch.Tensor, w: MoeWeights, cfg: ModelConfig) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers does it: normalise in float32, cast back, then scale.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def write_rows(plan: StepPlan, tokens: int, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """[tokens] the pool row each batch token's K/V goes to: its page at its slot and position, plus its offset
    (0 for padding); blink.engine.kernels.cache_rows does it in one launch."""
    return token_rows(plan.token_slot[:tokens], plan.token_pos[:tokens], plan.token_valid[:tokens], block_table,
                      page_size)


def token_rows(slot: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, block_table: torch.Tensor,
               page_size: int) -> torch.Tensor:
    """The pool row of each token at `slot`, `pos` (0 where not valid)."""
    pages = block_table[slot].gather(1, (pos // page_size)[:, None])[:, 0]
    return torch.where(valid, pages * page_size + pos % page_size, 0)


def one_query_rows(rows: QueryRows) -> torch.Tensor:
    """Which of decode_batch's tokens are real: the first rows.count."""
    return torch.arange(rows.start.shape[0], device=rows.start.device) < rows.count


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation over its fused projection's output [B, 2 * intermediate]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def split_heads(qkv: torch.Tensor, w: LayerWeights, cfg: ModelConfig,
                norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as [B, heads, head_dim] views of the fused projection, q and k through their norms where the
    model has them (norm: the kernel set's)."""
    heads = cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads  # side by side in the projection's output
    q, k, v = qkv.unflatten(-1, (-1, cfg.head_dim)).split(heads, dim=1)
    if w.q_norm is not None:
        q, k = norm(q, w.q_norm, cfg.rms_norm_eps), norm(k, w.k_norm, cfg.rms_norm_eps)
    return q, k, v


class TorchKernels:
    name = "torch"
    sampler = TORCH_SAMPLER
    bookkeeping = TORCH_BOOKKEEPING
    moe_captures = False  # moe.moe_mlp reads on the host which experts run

    def __init__(self, sliding_window: int | None):
        self.sliding_window = sliding_window

    def attention_batch(self, plan: StepPlan, shape: StepShape, block_table: torch.Tensor,
                        page_size: int) -> AttentionBatch:
        """Each row group gathered to the step's context bucket, at its exact row count (the host mode's)."""
        groups = [build_row_group(rows.head(n), block_table, page_size, queries, shape.context,
                                  self.sliding_window, shape.tokens)
                  for rows, n, queries in ((plan.decode_rows, shape.decode_rows, 1),
                                           (plan.chunk_rows, shape.chunk_rows, QUERY_BLOCK)) if n]
        return AttentionBatch(write_rows(plan, shape.tokens, block_table, page_size), groups)

    def decode_batch(self, rows: QueryRows, block_table: torch.Tensor, page_size: int,
                     context: int) -> AttentionBatch:
        R = rows.start.shape[0]
        group = build_row_group(rows, block_table, page_size, 1, context, self.sliding_window, R)
        return AttentionBatch(token_rows(rows.slot, rows.first_pos, one_query_rows(rows), block_table, page_size),
                              [group])

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return step_rope(cos, sin, positions)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def attention(self, qkv: torch.Tensor, w: LayerWeights, cfg: ModelConfig, tokens: Tokens, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # Queries and keys rotate together: they lie side by side in the projection's output.
        q_and_k = qkv[:, :cfg.q_size + cfg.kv_size].unflatten(-1, (-1, cfg.head_dim))
        if w.q_norm is not None:
            q_and_k = torch.cat([rms_norm(q_and_k[:, :cfg.num_heads], w.q_norm, cfg.rms_norm_eps),
                                 rms_norm(q_and_k[:, cfg.num_heads:], w.k_norm, cfg.rms_norm_eps)], 1)
        q_and_k = rotate(q_and_k, *tokens.rope)
        v = qkv[:, cfg.q_size + cfg.kv_size:].unflatten(-1, (-1, cfg.head_dim))
        return paged_attention(q_and_k[:, :cfg.num_heads], q_and_k[:, cfg.num_heads:], v, k_cache, v_cache,
                               tokens.batch, scale)

    def moe_mlp(self, h: torch.Tensor, w: MoeWeights, cfg: ModelConfig) -> torch.Tensor:
        return moe.moe_mlp(h, w, cfg.moe)


class CpuKernels(TorchKernels):
    name = "cpu"

    def __init__(self, sliding_window: int | None, ops):
        from blink.engine.kernels import cpu_commit, cpu_draft, cpu_hand_out, cpu_lay_out, cpu_make_room

        super().__init__(sliding_window)
        self._ops = ops  # torch.ops.blink_cpu
        # The bookkeeping's C++ twins (built with the kernels above): a call each in place of tens of torch ops.
        self.bookkeeping = Bookkeeping(
            PlanKernels(head=cpu_hand_out.head, hand_out=cpu_hand_out.hand_out, make_room=cpu_make_room.make_room,
                        lay_out=cpu_lay_out.lay_out),
            settle=cpu_commit.settle, settle_runs=cpu_commit.settle_runs, draft=cpu_draft.draft)

    def attention_batch(self, plan: StepPlan, shape: StepShape, block_table: torch.Tensor,
                        page_size: int) -> AttentionBatch:
        """Every batch token a one-query row for the kernel, decodes and prefill chunks alike, each attending to its
        sequence's keys up to its own position (rope_and_cache writes every token's K/V before any row reads): faster
        than gathering a chunk's context for SDPA at every prompt length measured (docs/design.md, Decisions)."""
        T, device = shape.tokens, plan.token_pos.device
        rows = QueryRows(torch.arange(T, device=device), torch.ones(T, dtype=torch.long, device=device),
                         plan.token_pos[:T], plan.token_slot[:T], plan.sizes.tokens)
        return AttentionBatch(write_rows(plan, T, block_table, page_size), [], [(rows, 1)], block_table)

    def decode_batch(self, rows: QueryRows, block_table: torch.Tensor, page_size: int,
                     context: int) -> AttentionBatch:
        written = token_rows(rows.slot, rows.first_pos, one_query_rows(rows), block_table, page_size)
        return AttentionBatch(written, [], [(rows, 1)], block_table)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ops.add_rms_norm(x, delta, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(gate_up)

    def attention(self, qkv: torch.Tensor, w: LayerWeights, cfg: ModelConfig, tokens: Tokens, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        batch = tokens.batch
        (rows, _), = batch.rows  # every token a one-query row (attention_batch)
        rows_args = (batch.block_table, rows.slot, rows.start, rows.first_pos, rows.count, scale,
                     self.sliding_window or 0)
        if w.q_norm is None:  # one call: rotations, the cache write and every row's attention
            return self._ops.decode_step_attention(qkv, cfg.num_heads, cfg.num_kv_heads, *tokens.rope,
                                                   batch.write_rows, k_cache, v_cache, *rows_args)
        q, k, v = split_heads(qkv, w, cfg, self.norm)
        q = self._ops.rope_and_cache(q, k, v, *tokens.rope, batch.write_rows, k_cache, v_cache)
        out = q.new_zeros(q.shape)
        self._ops.decode_attention(q, k_cache, v_cache, *rows_args, out)
        return out


class TritonKernels:
    name = "triton"
    moe_captures = True
    # The host mode on a GPU keeps the references; the device step binds its own Triton bookkeeping.
    bookkeeping = TORCH_BOOKKEEPING

    def __init__(self, sliding_window: int | None, device: torch.device):
        # Imported only when chosen: Triton is a Linux-only dependency, and without CUDA its interpreter must be
        # picked before a kernel is defined.
        if device.type != "cuda":
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from blink.engine.kernels import activation, attention, cache_rows, rms_norm
        from blink.engine.kernels import moe as experts
        from blink.engine.kernels.step_sampler import FUSED_SAMPLER

        self._attention, self._norm, self._activation, self._experts = attention, rms_norm, activation, experts
        self._cache_rows = cache_rows
        # A row pays for the features its request asked for, whatever the step was built to serve (a captured step
        # serves them all).
        self.sampler = FUSED_SAMPLER
        self.sliding_window = sliding_window

    def attention_batch(self, plan: StepPlan, shape: StepShape, block_table: torch.Tensor,
                        page_size: int) -> AttentionBatch:
        """The plan's row lists at the bucket's capacity: the kernels read each group's count on the device, and a
        row holds at least one token, so B rows cover every real one whatever the counts are."""
        B = shape.tokens
        rows = [(plan.decode_rows.head(B), 1), (plan.chunk_rows.head(B), QUERY_BLOCK)]
        placed = self._cache_rows.write_rows(plan.token_slot[:B], plan.token_pos[:B], plan.token_valid[:B],
                                             block_table, page_size)
        return AttentionBatch(placed, [], rows, block_table)

    def decode_batch(self, rows: QueryRows, block_table: torch.Tensor, page_size: int,
                     context: int) -> AttentionBatch:
        placed = self._cache_rows.write_rows(rows.slot, rows.first_pos, one_query_rows(rows), block_table, page_size)
        return AttentionBatch(placed, [], [(rows, 1)], block_table)

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cos, sin  # the kernel reads each token's row itself

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm.add_rms_norm(x, delta, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._activation.silu_and_mul(gate_up)

    def attention(self, qkv: torch.Tensor, w: LayerWeights, cfg: ModelConfig, tokens: Tokens, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        q, k, v = split_heads(qkv, w, cfg, self.norm)
        batch = tokens.batch
        # One launch: RoPE, the K/V cache write, and attention for decode rows and chunks; padding tokens belong to
        # no row: it writes them zeros, as the reference leaves them.
        rope = self._attention.Rope(k, v, *tokens.rope, tokens.positions)
        return self._attention.attention(q, k_cache, v_cache, batch.rows, batch.block_table, scale,
                                         self.sliding_window, batch.write_rows, rope=rope, kv_scales=w.kv_scales)

    def moe_mlp(self, h: torch.Tensor, w: MoeWeights, cfg: ModelConfig) -> torch.Tensor:
        return moe.grouped_moe_mlp(h, w, cfg.moe, self._experts)


KERNEL_SETS = ("torch", "cpu", "triton")
CPU_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ kernels are written for


def choose(cfg: ModelConfig, device: torch.device) -> KernelSet:
    """Triton on CUDA; on the CPU the C++ kernels where they build and take the model's heads (else the torch
    reference, saying why); BLINK_KERNELS names one instead."""
    from blink.engine.kernels import cpu

    name = os.environ.get("BLINK_KERNELS")
    if name is None:
        name = "triton" if device.type == "cuda" else "cpu" if cfg.dtype in CPU_DTYPES else "torch"
        if name == "cpu" and cfg.head_dim > cpu.MAX_HEAD_DIM:
            log.warning("the CPU kernels take heads of up to %d, this model's are %d; the torch reference runs "
                        "instead", cpu.MAX_HEAD_DIM, cfg.head_dim)
            name = "torch"
        elif name == "cpu":
            try:
                cpu.ops()
            except cpu.Unavailable as e:
                log.warning("%s; the torch reference runs instead", e)
                name = "torch"
    if name not in KERNEL_SETS:
        raise ValueError(f"BLINK_KERNELS must be one of {', '.join(KERNEL_SETS)}, got {name!r}")
    if name == "triton":
        return TritonKernels(cfg.sliding_window, device)
    if name == "cpu":
        if device.type != "cpu" or cfg.dtype not in CPU_DTYPES or cfg.head_dim > cpu.MAX_HEAD_DIM:
            raise ValueError(f"BLINK_KERNELS=cpu runs float32 or bfloat16 models with heads of up to "
                             f"{cpu.MAX_HEAD_DIM} on the CPU, not {cfg.dtype} heads of {cfg.head_dim} on {device.type}")
        return CpuKernels(cfg.sliding_window, cpu.ops())
    return TorchKernels(cfg.sliding_window)


