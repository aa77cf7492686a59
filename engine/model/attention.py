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
class Gather:
    """Up to GATHER_ROWS cache rows' worth of a group's rows, attended by one SDPA call."""

    read_index: torch.Tensor  # [r, Q] batch index of each query; padding reads any real one
    write_index: torch.Tensor  # [r, Q] where each result goes; padding: the trash index B
    pages: torch.Tensor  # [r * C / page_size] cache pages the rows read, row after row
    mask: torch.Tensor  # [r, 1, Q, C] True where the query may attend


@dataclass
class RowGroup:
    """One group's rows, cut into gathers once per step (every layer reads them)."""

    gathers: list[Gather]
    queries: int  # per row


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
    """Each row's `queries` batch tokens (padding beyond its length) and its first `context` cache rows; trash: the
    batch's token count B, where padding's results go."""
    device = rows.start.device
    real = torch.arange(rows.start.shape[0], device=device) < rows.count
    j = torch.arange(queries, device=device)
    valid = real[:, None] & (j[None, :] < rows.length[:, None])  # [R, Q]
    write_index = torch.where(valid, rows.start[:, None] + j[None, :], trash)
    read_index = write_index.clamp(max=trash - 1)
    pos = torch.where(valid, rows.first_pos[:, None] + j[None, :], 0)  # padding queries see cache row 0 only
    ctx = torch.arange(context, device=device)
    read_pages = block_table[rows.slot, : context // page_size]
    mask = ctx[None, None, :] <= pos[:, :, None]
    if sliding_window is not None:
        mask &= ctx[None, None, :] > pos[:, :, None] - sliding_window
    mask = mask[:, None]
    n, pages = read_pages.shape
    step = max(1, GATHER_ROWS // (pages * page_size))
    return RowGroup([Gather(read_index[i:i + step], write_index[i:i + step], read_pages[i:i + step].flatten(),
                            mask[i:i + step]) for i in range(0, n, step)], queries)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; k, v: [B, Hkv, D]; caches: [pages, page_size, Hkv, D]. Writes k/v, returns [B, Hq, D]."""
    heads, dim = k_cache.shape[2:]
    k_cache.view(-1, heads, dim).index_copy_(0, batch.write_rows, k)
    v_cache.view(-1, heads, dim).index_copy_(0, batch.write_rows, v)
    out = q.new_zeros(q.shape[0] + 1, *q.shape[1:])  # index B is the trash row
    attend_groups(q, k_cache, v_cache, batch.groups, scale, out)
    return out[:-1]


def attend_groups(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: list[RowGroup],
                  scale: float, out: torch.Tensor) -> None:
    """The groups' queries against their gathered context, written into out ([B + 1, Hq, D]: B is the trash row)."""
    heads, dim = k_cache.shape[2:]
    for group in groups:
        # SDPA's reduced-precision CPU kernel is slow for one-query rows (measured on a 2-core EPYC: 16 decode rows
        # of 128 keys, 1.26 ms in bfloat16 against 0.20 ms in float32): decodes attend in float32 there.
        upcast = q.device.type == "cpu" and q.dtype != torch.float32 and group.queries == 1
        for g in group.gathers:
            # Whole pages are gathered (index_select copies them as blocks): -> [r, Hkv, C, D].
            context = (g.mask.shape[0], g.mask.shape[-1], heads, dim)
            keys = k_cache.index_select(0, g.pages).view(context).transpose(1, 2)
            values = v_cache.index_select(0, g.pages).view(context).transpose(1, 2)
            queries = q[g.read_index].transpose(1, 2)  # [r, Hq, Q, D]
            if upcast:
                queries, keys, values = queries.float(), keys.float(), values.float()
            result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=scale,
                                                    enable_gqa=True)
            out[g.write_index] = result.transpose(1, 2).to(out.dtype)
