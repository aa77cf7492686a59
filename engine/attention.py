"""Paged attention over a ragged batch: the torch reference that Triton kernels are checked against.

Every token of the batch attends to its own sequence's first `position + 1` cache rows. The rows are
gathered through the block table into a fixed [tokens, context] grid, so shapes depend only on the
bucket sizes, never on the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Tokens per gather chunk: bounds the [chunk, context, kv_heads, head_dim] gather buffer.
GATHER_CHUNK = 128


@dataclass
class AttentionBatch:
    """Per-step indexing shared by every layer."""

    write_rows: torch.Tensor  # [B] flat cache row each token's K/V is written to
    read_rows: torch.Tensor  # [B, C] flat cache rows each token reads
    read_mask: torch.Tensor  # [B, 1, 1, C] True where the token may attend


def build_attention_batch(
    token_slot: torch.Tensor,
    token_pos: torch.Tensor,
    token_valid: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    context: int,
    sliding_window: int | None,
) -> AttentionBatch:
    """token_*: [B]; block_table: [S, pages per sequence]. Padding tokens write to the null page (0)."""
    pages = block_table[token_slot]  # [B, pages]
    write_rows = pages.gather(1, (token_pos // page_size)[:, None])[:, 0] * page_size + token_pos % page_size
    write_rows = torch.where(token_valid, write_rows, torch.zeros_like(write_rows))
    ctx = torch.arange(context, device=token_pos.device)
    read_rows = pages[:, ctx // page_size] * page_size + ctx % page_size  # [B, C]
    mask = ctx[None, :] <= token_pos[:, None]
    if sliding_window is not None:
        mask &= ctx[None, :] > token_pos[:, None] - sliding_window
    return AttentionBatch(write_rows, read_rows, mask[:, None, None, :])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D]; k, v: [B, Hkv, D]; caches: [rows, Hkv, D]. Writes k/v, returns [B, Hq, D]."""
    k_cache.index_copy_(0, batch.write_rows, k)
    v_cache.index_copy_(0, batch.write_rows, v)
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], GATHER_CHUNK):
        end = min(start + GATHER_CHUNK, q.shape[0])
        rows = batch.read_rows[start:end]
        keys = k_cache[rows].transpose(1, 2)  # [b, Hkv, C, D]
        values = v_cache[rows].transpose(1, 2)
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end, :, None, :], keys, values, attn_mask=batch.read_mask[start:end], scale=scale,
            enable_gqa=True,
        )[:, :, 0, :]
    return out
