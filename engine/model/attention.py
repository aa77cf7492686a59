"""Paged attention over a ragged batch: the torch reference that Triton kernels are checked against.

A row is a run of consecutive batch tokens of one sequence; each token attends to its sequence's first
`position + 1` cache rows. Rows come in two groups so padding stays small: decodes as [rows, 1] queries,
prefill chunks cut into blocks as [rows, QUERY_BLOCK] queries. Each row's context is gathered once, whole
pages at a time, into a [rows, context] grid. All shapes come from the step's buckets, never the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from blink.engine.core.scheduler import QueryRows

# Bounds a group's gathered context to about this many cache rows per SDPA call.
GATHER_ROWS = 1 << 16


@dataclass
class RowGroup:
    token_index: torch.Tensor  # [R, Q] batch index of each query; padding points at the trash index B
    read_pages: torch.Tensor  # [R, C / page_size] cache pages the row reads, in order
    mask: torch.Tensor  # [R, 1, Q, C] True where the query may attend


@dataclass
class AttentionBatch:
    """Per-step indexing shared by every layer: `groups` for the torch reference, `rows` for the Triton kernels."""

    write_rows: torch.Tensor  # [B] flat cache row each token's K/V is written to (padding: the null page)
    groups: list[RowGroup]
    # The plan's row groups at a capacity fixed by the bucket, with their queries per row; the kernels read each
    # group's count on the device.
    rows: list[tuple[QueryRows, int]] = field(default_factory=list)
    block_table: torch.Tensor | None = None  # [slots, pages per sequence + 1]


def build_row_group(rows: QueryRows, block_table: torch.Tensor, page_size: int, queries: int, context: int,
                    sliding_window: int | None, trash: int) -> RowGroup:
    """Each row's `queries` batch tokens (padding beyond its length) and its first `context` cache rows."""
    device = rows.start.device
    real = torch.arange(rows.start.shape[0], device=device) < rows.count
    j = torch.arange(queries, device=device)
    valid = real[:, None] & (j[None, :] < rows.length[:, None])  # [R, Q]
    token_index = torch.where(valid, rows.start[:, None] + j[None, :], trash)
    pos = torch.where(valid, rows.first_pos[:, None] + j[None, :], 0)  # padding queries see cache row 0 only
    ctx = torch.arange(context, device=device)
    read_pages = block_table[rows.slot, : context // page_size]
    mask = ctx[None, None, :] <= pos[:, :, None]
    if sliding_window is not None:
        mask &= ctx[None, None, :] > pos[:, :, None] - sliding_window
    return RowGroup(token_index, read_pages, mask[:, None])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; k, v: [B, Hkv, D]; caches: [pages, page_size, Hkv, D]. Writes k/v, returns [B, Hq, D]."""
    _, page_size, heads, dim = k_cache.shape
    k_cache.view(-1, heads, dim).index_copy_(0, batch.write_rows, k)
    v_cache.view(-1, heads, dim).index_copy_(0, batch.write_rows, v)
    B = q.shape[0]
    q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])  # index B is the trash row
    out = torch.zeros_like(q)
    for group in batch.groups:
        # SDPA's reduced-precision CPU kernel is slow for one-query rows (measured on a 2-core EPYC: 16 decode rows
        # of 128 keys, 1.26 ms in bfloat16 against 0.20 ms in float32): decodes attend in float32 there.
        upcast = q.device.type == "cpu" and q.dtype != torch.float32 and group.token_index.shape[1] == 1
        rows, pages = group.read_pages.shape
        step = max(1, GATHER_ROWS // (pages * page_size))
        for start in range(0, rows, step):
            part = slice(start, start + step)
            index = group.token_index[part]
            # Whole pages are gathered (index_select copies them as blocks): -> [r, Hkv, C, D].
            read = group.read_pages[part]
            context = (read.shape[0], read.shape[1] * page_size, heads, dim)
            keys = k_cache.index_select(0, read.flatten()).view(context).transpose(1, 2)
            values = v_cache.index_select(0, read.flatten()).view(context).transpose(1, 2)
            queries = q[index].transpose(1, 2)  # [r, Hq, Q, D]
            if upcast:
                queries, keys, values = queries.float(), keys.float(), values.float()
            result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask[part],
                                                    scale=scale, enable_gqa=True)
            out[index] = result.transpose(1, 2).to(out.dtype)
    return out[:B]
