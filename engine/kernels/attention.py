"""Paged attention over ragged query rows as one Triton kernel; engine/attention.py is the reference it must match.

A program takes one row (consecutive batch tokens of one sequence) and one KV head, or a slice of that head's query
heads: the row's queries times those heads form one tile of queries, which sweeps the row's context in tiles of
keys with an online softmax, finding each key's cache row through the block table. Programs past the row count
(read on the device) return at once, so the grid depends only on the rows' capacity: no host sync, graph-safe.

Decode rows can also split their context (flash-decoding): a batch-1 decode is a program per KV head, 8 programs on
a GPU of 132 SMs, each reading the whole context alone. With SPLITS > 1 each program sweeps one of SPLITS equal
spans of its row's keys (sized on the device from the row's length), writes its running maximum, sum and
unnormalised output, and a second kernel merges the spans of each (row, head).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from blink.engine.core.scheduler import QueryRows

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs M, N and K of at least 16 on the GPU
ACCUMULATOR = 128 * 128  # fp32 accumulator elements one program holds (queries x heads x head_dim) at most
KEY_TILE = 64
MAX_SPLITS = 16  # key spans a decode row splits into at most


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton 3.6's interpreter multiplies bfloat16 tiles as integers; their float32 products are exact
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, k_ptr, v_ptr, table_ptr,
    start_ptr, length_ptr, first_pos_ptr, slot_ptr, count_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_table,
    scale_log2, window, span_max, span_sum, span_acc, heads,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2) % SPLITS
    if row >= tl.load(count_ptr):
        return
    start = tl.load(start_ptr + row)
    length = tl.load(length_ptr + row)
    first_pos = tl.load(first_pos_ptr + row)
    slot = tl.load(slot_ptr + row)

    # Tile row m is query m // BLOCK_H of the row, for query head (m % BLOCK_H) of this program's slice.
    m = tl.arange(0, BLOCK_M)
    query = m // BLOCK_H
    in_group = tl.program_id(2) // SPLITS * BLOCK_H + m % BLOCK_H
    head = kv_head * GROUP + in_group
    live = (query < length) & (in_group < GROUP)
    pos = first_pos + query
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = live[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (start + query)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)

    end = first_pos + length  # the row's last query sees keys up to end - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    if SPLITS > 1:  # this program's span of the keys: whole key tiles, the last spans possibly empty
        span = tl.cdiv(tl.cdiv(end - lo, SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * span
        end = tl.minimum(end, lo + span)
    # A finite floor keeps rows that see no key in a tile (or padding rows) free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # A while loop, not `for range(lo, end, ...)`: Triton 3.6's interpreter cannot take a loaded bound with numpy 2.4.
    n0 = lo
    while n0 < end:
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(table_ptr + slot * stride_table + n // PAGE_SIZE, mask=n_ok, other=0)
        offset = n % PAGE_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (page * stride_kp + offset * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (page * stride_vp + offset * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale_log2
        visible = n[None, :] <= pos[:, None]
        if HAS_WINDOW:
            visible &= n[None, :] > pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new
        n0 += BLOCK_N
    if SPLITS > 1:  # decode rows: one query, tile row m is query head m of the slice
        at = (row * heads + head) * SPLITS + split
        tl.store(span_max + at, m_i, mask=live)
        tl.store(span_sum + at, l_i, mask=live)
        tl.store(span_acc + at[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
    else:
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (start + query)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_spans_kernel(out_ptr, start_ptr, count_ptr, span_max, span_sum, span_acc, stride_ot, stride_oh, heads,
                        HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (decode row, query head): its spans' online-softmax states merged into the attention output."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    if row >= tl.load(count_ptr):
        return
    at = (row * heads + head) * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(span_max + at)
    weight = tl.exp2(m - tl.max(m, 0))  # spans that saw no key hold the finite floor and a zero sum
    total = tl.sum(tl.load(span_sum + at) * weight, 0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(span_acc + at[:, None] * HEAD_DIM + d[None, :], mask=d[None, :] < HEAD_DIM, other=0.0)
    acc = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + tl.load(start_ptr + row) * stride_ot + head * stride_oh + d,
             acc.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def key_splits(q: torch.Tensor, kv_heads: int, queries_per_row: int) -> int:
    """How many key spans decode rows split into: enough programs to cover a GPU's SMs about twice when a single
    row decodes (how many do is on the device; spans past a short context exit at once, and many long rows pay a
    merge of a few kilobytes per head). Prefill rows, and the CPU: none."""
    if queries_per_row != 1 or q.device.type != "cuda":
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(-(-2 * _multiprocessors(q.device.index) // kv_heads)))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: QueryRows,
                    queries_per_row: int, block_table: torch.Tensor, scale: float, sliding_window: int | None,
                    out: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Writes attention for the tokens of `rows` into out and returns it; other tokens of out are left alone.

    q, out: [B, Hq, D]; caches: one layer's [pages, page_size, Hkv, D] (K/V of this step already written);
    block_table: [slots, pages per sequence]; every real row is at most `queries_per_row` tokens long.
    splits: key spans per decode row (a power of two; None: `key_splits`'s choice).
    """
    _, page_size, kv_heads, head_dim = k_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads
    capacity = rows.start.shape[0]
    assert heads == group * kv_heads and q.stride(-1) == out.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and block_table.stride(-1) == 1
    assert queries_per_row & (queries_per_row - 1) == 0 and page_size & (page_size - 1) == 0
    if capacity == 0 or q.shape[0] == 0:
        return out
    # Decode rows take a whole GQA group per program; long rows split it so the accumulator stays in registers.
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    block_h = min(triton.next_power_of_2(group), max(1, ACCUMULATOR // (queries_per_row * block_d)))
    block_m = max(MIN_DOT, queries_per_row * block_h)
    splits = key_splits(q, kv_heads, queries_per_row) if splits is None else splits
    assert splits == 1 or queries_per_row == 1, "only decode rows split their keys"
    assert splits & (splits - 1) == 0
    spans = [torch.empty((capacity, heads, splits, *shape), dtype=torch.float32, device=q.device)
             for shape in ((), (), (head_dim,))] if splits > 1 else [q] * 3  # max, sum, unnormalised output
    grid = (capacity, kv_heads, triton.cdiv(group, block_h) * splits)
    _paged_attention_kernel[grid](
        q, out, k_cache, v_cache, block_table,
        rows.start, rows.length, rows.first_pos, rows.slot, rows.count,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
        scale * LOG2E, sliding_window or 0, *spans, heads,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, HAS_WINDOW=sliding_window is not None,
        BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_N=KEY_TILE, BLOCK_D=block_d,
        # float32 through three TF32 products: about float32's accuracy on tensor cores (ieee spills on Hopper).
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and q.device.type == "cpu",  # on the CPU Triton only interprets
        SPLITS=splits, num_warps=4 if block_m * block_d <= ACCUMULATOR // 2 else 8,
    )
    if splits > 1:
        _merge_spans_kernel[(capacity, heads)](out, rows.start, rows.count, *spans, out.stride(0), out.stride(1),
                                               heads, HEAD_DIM=head_dim, SPLITS=splits, BLOCK_D=block_d)
    return out
