"""Paged attention over ragged query rows as one Triton kernel; engine/attention.py is the reference it must match.

A program takes one row (consecutive batch tokens of one sequence) and one KV head, or a slice of that head's query
heads: the row's queries times those heads form one tile of queries, which sweeps the row's context in tiles of
keys with an online softmax, finding each key's cache row through the block table. Programs past the row count
(read on the device) return at once, so the grid depends only on the rows' capacity: no host sync, graph-safe.
A step's decode rows and prefill chunks (blocks of QUERY_BLOCK queries) are one launch (`attention`): each group has
its own programs, so a decode-only step pays no chunk kernel, only chunk programs that return; the same launch
writes zeros to the batch's padding tokens, so its output needs no zeroing first. Given the step's keys and values
(`Rope`), it also does engine/kernels/rope_kv.py's work: each program ropes its queries, one program per row ropes
and writes the row's K/V to the cache, and keys this step computes (the row's own, a prompt's earlier blocks) are
read from the projection's output and roped where they are used, never from cache rows another program of the
launch may not have written yet.

Decode rows can also split their context (flash-decoding): a batch-1 decode is a program per KV head, 8 programs on
a GPU of 132 SMs, each reading the whole context alone. With SPLITS > 1 each row's programs choose on the device how
many spans its keys take (enough programs for twice the SMs over the live rows, MIN_SPAN keys a span at least,
whole key tiles, no empty span); each writes its running maximum, sum and unnormalised output, takes a ticket on the
row's lock, and the last to finish merges the spans into the output and leaves the lock at zero: no second kernel.

FP8 pages (`--kv-cache-dtype fp8`, blink.engine.core.kv_dtype): K and V are stored as round(x / scale) in float8 with
the layer's scales (`kv_scales`), and read back times the scale in the model's dtype; this step's keys, read from the
projection, go through the same rounding (engine/kernels/tile_math.py), so a key attends the same whether it was
computed now or read from a page.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from blink.engine.core.scheduler import QueryRows
from blink.engine.kernels.tickets import last_to_finish, tickets
from blink.engine.kernels.tile_math import dot, fp8_round_bits, from_fp8, roped, to_fp8

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs M, N and K of at least 16 on the GPU
ACCUMULATOR = 128 * 128  # fp32 accumulator elements one program holds (queries x heads x head_dim) at most
KEY_TILE = 64
MAX_SPLITS = 16  # key spans a decode row splits into at most
MIN_SPAN = 4 * KEY_TILE  # keys a span holds at least: shorter, its merge costs more than the split saves


@triton.jit
def _sweep(q, k_ptr, v_ptr, table_ptr, slot, pos, lo, end, window, scale_log2,
           stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_table, kv_head, d, d_ok,
           start, first_pos, tokens, pos_ptr, write_ptr, k_new, v_new, stride_nkt, stride_nkh, stride_nvt,
           stride_nvh, cos_ptr, sin_ptr, stride_cos, k_scale, v_scale,
           PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROPE: tl.constexpr,
           HALF: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_BITS: tl.constexpr):
    """The tile of queries `q` against the row's keys lo..end-1 with an online softmax: its running maximum, sum and
    unnormalised output. ROPE: this step's keys of the sequence (the batch tokens before the row's own, back to
    the first the step computes of it: a token of that position whose cache row is this one) are read from the
    projection's output and roped here, not from the cache, which other programs of this launch may be writing.
    FP8: the pages hold float8, read times k_scale / v_scale in q's dtype (this step's keys rounded as if stored)."""
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
        fresh = n_ok & (n < 0)  # no key is this step's unless ROPE finds it so
        if ROPE:
            at = start + n - first_pos  # where this step would hold the key at n, batch tokens being consecutive
            maybe = n_ok & (at >= 0) & (at < tokens)
            fresh = maybe & (tl.load(pos_ptr + at, mask=maybe, other=-1) == n)
            fresh &= tl.load(write_ptr + at, mask=fresh, other=-1) == page * PAGE_SIZE + offset
        old = kv_mask & ~fresh[:, None]
        k = tl.load(k_ptr + (page * stride_kp + offset * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                    mask=old, other=0.0)
        v = tl.load(v_ptr + (page * stride_vp + offset * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=old, other=0.0)
        if FP8:
            k, v = from_fp8(k, k_scale, q.dtype), from_fp8(v, v_scale, q.dtype)
        if ROPE:  # noqa: SIM102 (a constexpr's branch, pruned when compiled; the tile's test runs on the device)
            if tl.max(fresh.to(tl.int32), 0) > 0:  # only tiles holding this step's keys (a decode's last) rope them
                new = kv_mask & fresh[:, None]
                k_fresh = roped(k_new + (at * stride_nkt + kv_head * stride_nkh)[:, None], d[None, :], n[:, None],
                                new, cos_ptr, sin_ptr, stride_cos, HALF)
                v_fresh = tl.load(v_new + (at * stride_nvt + kv_head * stride_nvh)[:, None] + d[None, :], mask=new,
                                  other=0.0)
                if FP8:
                    k_fresh = from_fp8(to_fp8(k_fresh, k_scale, k_ptr.dtype.element_ty, FP8_MAX, ROUND_BITS),
                                       k_scale, q.dtype)
                    v_fresh = from_fp8(to_fp8(v_fresh, v_scale, v_ptr.dtype.element_ty, FP8_MAX, ROUND_BITS),
                                       v_scale, q.dtype)
                k = tl.where(new, k_fresh, k)
                v = tl.where(new, v_fresh, v)
        s = dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale_log2
        visible = n[None, :] <= pos[:, None]
        if HAS_WINDOW:
            visible &= n[None, :] > pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new
        n0 += BLOCK_N
    return m_i, l_i, acc


@triton.jit
def _attend_row(q_ptr, out_ptr, k_ptr, v_ptr, table_ptr, row, kv_head, hblock, split, n_rows,
                start_ptr, length_ptr, first_pos_ptr, slot_ptr,
                stride_qt, stride_qh, stride_ot, stride_oh,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_table,
                scale_log2, window, span_max, span_sum, span_acc, locks, heads, programs, min_span,
                tokens, pos_ptr, write_ptr, k_new, v_new, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
                cos_ptr, sin_ptr, stride_cos, writes, kv_scales,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLITS: tl.constexpr, ROPE: tl.constexpr,
                HALF: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_BITS: tl.constexpr):
    """One row's queries for one KV head's slice of query heads, or (SPLITS > 1, decode rows) one span of its keys.
    ROPE: q arrives unroped (roped here), and the program that `writes` puts the row's own keys (roped) and values
    into the cache for later steps."""
    start = tl.load(start_ptr + row)
    length = tl.load(length_ptr + row)
    first_pos = tl.load(first_pos_ptr + row)
    slot = tl.load(slot_ptr + row)
    k_scale, v_scale = 1.0, 1.0
    if FP8:  # the layer's scales, read on the device: a captured step serves any checkpoint's
        k_scale, v_scale = tl.load(kv_scales), tl.load(kv_scales + 1)

    # Tile row m is query m // BLOCK_H of the row, for query head (m % BLOCK_H) of this program's slice.
    m = tl.arange(0, BLOCK_M)
    query = m // BLOCK_H
    in_group = hblock * BLOCK_H + m % BLOCK_H
    head = kv_head * GROUP + in_group
    live = (query < length) & (in_group < GROUP)
    pos = first_pos + query
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = live[:, None] & d_ok[None, :]
    out_at = out_ptr + (start + query)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]

    end = first_pos + length  # the row's last query sees keys up to end - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    spans = 1
    if SPLITS > 1:
        # How many spans this row's keys split into, chosen here from what is live: enough programs for the GPU
        # (`programs` over the live rows' programs), none shorter than min_span keys; whole key tiles, none empty.
        kv_heads = tl.num_programs(1)
        hblocks = (GROUP + BLOCK_H - 1) // BLOCK_H
        wanted = tl.maximum((programs + n_rows * kv_heads * hblocks - 1) // (n_rows * kv_heads * hblocks), 1)
        spans = tl.minimum(tl.minimum(wanted, tl.maximum((end - lo + min_span - 1) // min_span, 1)), SPLITS)
        span = tl.cdiv(tl.cdiv(end - lo, spans), BLOCK_N) * BLOCK_N
        spans = tl.cdiv(end - lo, span)
        lo = lo + split * span
        end = tl.minimum(end, lo + span)
    if ROPE:  # the program that `writes`: the row's tokens' K/V, roped, into their cache rows (tile row m: token m)
        mine = (m < length) & writes
        own = mine[:, None] & d_ok[None, :]
        cache_row = tl.load(write_ptr + start + m, mask=mine, other=0)
        page_of, offset_of = cache_row // PAGE_SIZE, cache_row % PAGE_SIZE
        k_own = roped(k_new + ((start + m) * stride_nkt + kv_head * stride_nkh)[:, None], d[None, :],
                       (first_pos + m)[:, None], own, cos_ptr, sin_ptr, stride_cos, HALF)
        v_own = tl.load(v_new + ((start + m) * stride_nvt + kv_head * stride_nvh)[:, None] + d[None, :], mask=own,
                        other=0.0)
        if FP8:
            k_own = to_fp8(k_own, k_scale, k_ptr.dtype.element_ty, FP8_MAX, ROUND_BITS)
            v_own = to_fp8(v_own, v_scale, v_ptr.dtype.element_ty, FP8_MAX, ROUND_BITS)
        tl.store(k_ptr + (page_of * stride_kp + offset_of * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                 k_own, mask=own)
        tl.store(v_ptr + (page_of * stride_vp + offset_of * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                 v_own, mask=own)
    if split < spans:
        q_at = q_ptr + (start + query)[:, None] * stride_qt + head[:, None] * stride_qh
        if ROPE:
            q = roped(q_at, d[None, :], pos[:, None], q_mask, cos_ptr, sin_ptr, stride_cos, HALF)
        else:
            q = tl.load(q_at + d[None, :], mask=q_mask, other=0.0)
        m_i, l_i, acc = _sweep(q, k_ptr, v_ptr, table_ptr, slot, pos, lo, end, window, scale_log2,
                               stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_table,
                               kv_head, d, d_ok, start, first_pos, tokens, pos_ptr, write_ptr, k_new, v_new,
                               stride_nkt, stride_nkh, stride_nvt, stride_nvh, cos_ptr, sin_ptr, stride_cos,
                               k_scale, v_scale, PAGE_SIZE, HAS_WINDOW, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION,
                               UPCAST, ROPE, HALF, FP8, FP8_MAX, ROUND_BITS)
        if spans == 1:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            # Decode rows: one query, tile row m is query head m of the slice. The span's state goes out; the last
            # of the row's spans to finish (a ticket on its lock) merges them all and leaves the lock at zero.
            at = (row * heads + head) * SPLITS
            tl.store(span_max + at + split, m_i, mask=live)
            tl.store(span_sum + at + split, l_i, mask=live)
            tl.store(span_acc + (at + split)[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
            lock = locks + (row * tl.num_programs(1) + kv_head) * ((GROUP + BLOCK_H - 1) // BLOCK_H) + hblock
            if last_to_finish(lock, spans):
                top = tl.full([BLOCK_M], -1.0e30, tl.float32)
                total = tl.zeros([BLOCK_M], tl.float32)
                merged = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                i = 0
                while i < spans:  # online, span by span: the other programs' states read from L2
                    m_s = tl.load(span_max + at + i, mask=live, other=-1.0e30, cache_modifier=".cg")
                    l_s = tl.load(span_sum + at + i, mask=live, other=0.0, cache_modifier=".cg")
                    a_s = tl.load(span_acc + (at + i)[:, None] * HEAD_DIM + d[None, :], mask=q_mask, other=0.0,
                                  cache_modifier=".cg")
                    new_top = tl.maximum(top, m_s)
                    old, this = tl.exp2(top - new_top), tl.exp2(m_s - new_top)
                    total = total * old + l_s * this
                    merged = merged * old[:, None] + a_s * this[:, None]
                    top = new_top
                    i += 1
                merged = merged / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(out_at, merged.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, k_ptr, v_ptr, table_ptr, write_ptr, tokens,
    d_start, d_length, d_first_pos, d_slot, d_count, d_programs,
    c_start, c_length, c_first_pos, c_slot, c_count,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_table,
    scale_log2, window, span_max, span_sum, span_acc, locks, heads, programs, min_span,
    pos_ptr, k_new, v_new, stride_nkt, stride_nkh, stride_nvt, stride_nvh, cos_ptr, sin_ptr, stride_cos, kv_scales,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    DECODES: tl.constexpr, D_BLOCK_H: tl.constexpr, D_BLOCK_M: tl.constexpr, SPLITS: tl.constexpr,
    CHUNKS: tl.constexpr, C_QUERIES: tl.constexpr, C_BLOCK_H: tl.constexpr, C_BLOCK_M: tl.constexpr,
    ZERO_PADDING: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    ROUND_BITS: tl.constexpr,
):
    """One launch for a step: along axis 0, first d_programs rows of decode programs (each a head slice and a span
    of keys: D_Z of them; they also zero the batch's padding tokens), then the prefill chunks' rows (blocks of
    C_QUERIES, a program per head slice); a program past its group's row count (read here) returns."""
    kv_head = tl.program_id(1)
    D_Z: tl.constexpr = ((GROUP + D_BLOCK_H - 1) // D_BLOCK_H) * SPLITS
    C_Z: tl.constexpr = (GROUP + C_BLOCK_H - 1) // C_BLOCK_H
    pid = tl.program_id(0) // D_Z
    z = tl.program_id(0) % D_Z
    if pid < d_programs:
        hblock = z // SPLITS
        if ZERO_PADDING:  # a token of no row (its K/V write goes to the null row 0) gets zeros, as the reference's
            padding = tl.load(write_ptr + pid, mask=pid < tokens, other=1) == 0
            if padding & (z % SPLITS == 0):
                m = tl.arange(0, D_BLOCK_H)
                d = tl.arange(0, BLOCK_D)
                in_group = hblock * D_BLOCK_H + m
                head = kv_head * GROUP + in_group
                tl.store(out_ptr + pid * stride_ot + head[:, None] * stride_oh + d[None, :],
                         tl.zeros([D_BLOCK_H, BLOCK_D], out_ptr.dtype.element_ty),
                         mask=(in_group < GROUP)[:, None] & (d < HEAD_DIM)[None, :])
        if DECODES:
            n_rows = tl.load(d_count)
            if (pid < n_rows) & (hblock * D_BLOCK_H < GROUP):
                _attend_row(q_ptr, out_ptr, k_ptr, v_ptr, table_ptr, pid, kv_head, hblock, z % SPLITS, n_rows,
                            d_start, d_length, d_first_pos, d_slot,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_table,
                            scale_log2, window, span_max, span_sum, span_acc, locks, heads, programs, min_span,
                            tokens, pos_ptr, write_ptr, k_new, v_new, stride_nkt, stride_nkh, stride_nvt,
                            stride_nvh, cos_ptr, sin_ptr, stride_cos, z == 0, kv_scales,
                            GROUP, HEAD_DIM, PAGE_SIZE, HAS_WINDOW, D_BLOCK_H, D_BLOCK_M, BLOCK_N, BLOCK_D,
                            DOT_PRECISION, UPCAST, SPLITS, ROPE, HALF, FP8, FP8_MAX, ROUND_BITS)
    elif CHUNKS:
        row = (tl.program_id(0) - d_programs * D_Z) // C_Z
        z = (tl.program_id(0) - d_programs * D_Z) % C_Z
        n_rows = tl.load(c_count)
        if (row < n_rows) & (z * C_BLOCK_H < GROUP):
            _attend_row(q_ptr, out_ptr, k_ptr, v_ptr, table_ptr, row, kv_head, z, 0, n_rows,
                        c_start, c_length, c_first_pos, c_slot,
                        stride_qt, stride_qh, stride_ot, stride_oh,
                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_table,
                        scale_log2, window, span_max, span_sum, span_acc, locks, heads, programs, min_span,
                        tokens, pos_ptr, write_ptr, k_new, v_new, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
                        cos_ptr, sin_ptr, stride_cos, z == 0, kv_scales,
                        GROUP, HEAD_DIM, PAGE_SIZE, HAS_WINDOW, C_BLOCK_H, C_BLOCK_M, BLOCK_N, BLOCK_D,
                        DOT_PRECISION, UPCAST, 1, ROPE, HALF, FP8, FP8_MAX, ROUND_BITS)


@dataclass
class Rope:
    """What `attention` ropes and writes to the cache itself: this step's keys and values [B, Hkv, D] (strided views
    of the projection, head_dim contiguous), the RoPE tables [max_len, D] and each token's position [B]."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor


def key_splits(q: torch.Tensor, kv_heads: int) -> int:
    """The most key spans a decode row splits into: on a GPU, enough programs to cover its SMs about twice when a
    single row decodes (each row takes fewer on the device as more rows are live or its context is short); on the
    CPU, none."""
    if q.device.type != "cuda":
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(-(-2 * _multiprocessors(q.device.index) // kv_heads)))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs(device: torch.device) -> int:
    """The programs a step's decode rows should make at least: twice the SMs (on the CPU, a number for the tests)."""
    return 2 * (_multiprocessors(device.index) if device.type == "cuda" else 132)


def _span_state(rows: int, heads: int, splits: int, head_dim: int, device: torch.device) -> list[torch.Tensor]:
    """Where spans leave their state for the merge: [rows, heads, splits] maxima and sums, [..., D] outputs."""
    return [torch.empty((rows, heads, splits, *shape), dtype=torch.float32, device=device)
            for shape in ((), (), (head_dim,))]


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              groups: list[tuple[QueryRows, int]], block_table: torch.Tensor, scale: float,
              sliding_window: int | None, write_rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
              splits: int | None = None, min_span: int = MIN_SPAN, rope: Rope | None = None,
              kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for the tokens of the row groups (decode rows: one query each; chunk rows: up to QUERY_BLOCK),
    in one launch, into `out` (new if None), returned.

    q, out: [B, Hq, D]; caches: one layer's [pages, page_size, Hkv, D] (K/V of this step already written);
    block_table: [slots, pages per sequence]; groups: (rows, queries per row), at most one of each kind.
    write_rows: each token's cache row ([B], 0 for padding): given, the tokens of no row get zeros, so `out` needs
    no zeroing first; None leaves them alone. splits: the most key spans a decode row splits into (a power of two;
    None: `key_splits`'s), how many it does is chosen on the device; min_span: the fewest keys a span holds.
    rope: this step's keys and values and the RoPE tables: q is then unroped, and the launch ropes q, writes the
    rows' K/V (roped) to the cache rows `write_rows` and reads this step's keys from `rope`, not from the cache
    (engine/kernels/rope_kv.py's work, in the same launch); None: q is roped and the cache already written.
    kv_scales: float8 caches' K and V scales of this layer (float32 [2]; None: 1.0).
    """
    _, page_size, kv_heads, head_dim = k_cache.shape
    B, heads = q.shape[:2]
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    assert heads == group * kv_heads and q.stride(-1) == out.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and block_table.stride(-1) == 1
    assert page_size & (page_size - 1) == 0 and min_span % KEY_TILE == 0
    decodes = [rows for rows, queries in groups if queries == 1]
    chunks = [(rows, queries) for rows, queries in groups if queries > 1]
    assert len(decodes) <= 1 and len(chunks) <= 1 and all(queries & (queries - 1) == 0 for _, queries in chunks)
    d_capacity = decodes[0].start.shape[0] if decodes else 0
    c_capacity = chunks[0][0].start.shape[0] if chunks else 0
    zero_padding = write_rows is not None
    d_programs = max(d_capacity, B if zero_padding else 0)
    if B == 0 or d_programs + c_capacity == 0:
        return out
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))

    def tiling(queries: int) -> tuple[int, int]:
        # Decode rows take a whole GQA group per program; long rows split it so the accumulator stays in registers.
        block_h = min(triton.next_power_of_2(group), max(1, ACCUMULATOR // (queries * block_d)))
        return block_h, max(MIN_DOT, queries * block_h)

    c_queries = chunks[0][1] if chunks else 1
    (d_block_h, d_block_m), (c_block_h, c_block_m) = tiling(1), tiling(c_queries)
    splits = (key_splits(q, kv_heads) if splits is None else splits) if decodes else 1
    assert splits & (splits - 1) == 0
    hblocks = triton.cdiv(group, d_block_h)
    spans = _span_state(d_capacity, heads, splits, head_dim, q.device) if splits > 1 else [q] * 3
    locks = tickets("attention", q.device, d_capacity * kv_heads * hblocks) if splits > 1 else q
    d_rows = decodes[0] if decodes else chunks[0][0]  # an absent group's pointers are never read
    c_rows = chunks[0][0] if chunks else d_rows
    if rope is not None:
        assert zero_padding and head_dim % 2 == 0 and rope.k.stride(-1) == rope.v.stride(-1) == 1
        assert rope.cos.is_contiguous() and rope.sin.is_contiguous()
        fresh = (rope.positions, rope.k, rope.v, *rope.k.stride()[:2], *rope.v.stride()[:2], rope.cos, rope.sin,
                 rope.cos.stride(0))
    else:
        fresh = (q, q, q, 0, 0, 0, 0, q, q, 0)  # never read
    fp8 = k_cache.element_size() == 1
    if fp8:
        assert v_cache.dtype == k_cache.dtype and q.dtype != k_cache.dtype
        kv_scales = torch.ones(2, dtype=torch.float32, device=q.device) if kv_scales is None else kv_scales
        assert kv_scales.dtype == torch.float32 and kv_scales.numel() == 2 and kv_scales.is_contiguous()
    grid = (d_programs * hblocks * splits + c_capacity * triton.cdiv(group, c_block_h), kv_heads)
    _paged_attention_kernel[grid](
        q, out, k_cache, v_cache, block_table, write_rows if zero_padding else d_rows.start, B,
        d_rows.start, d_rows.length, d_rows.first_pos, d_rows.slot, d_rows.count, d_programs,
        c_rows.start, c_rows.length, c_rows.first_pos, c_rows.slot, c_rows.count,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
        scale * LOG2E, sliding_window or 0, *spans, locks, heads, _programs(q.device), min_span, *fresh,
        kv_scales if fp8 else q,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, HAS_WINDOW=sliding_window is not None,
        BLOCK_N=KEY_TILE, BLOCK_D=block_d,
        # float32 through three TF32 products: about float32's accuracy on tensor cores (ieee spills on Hopper).
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and q.device.type == "cpu",  # on the CPU Triton only interprets
        DECODES=bool(decodes), D_BLOCK_H=d_block_h, D_BLOCK_M=d_block_m, SPLITS=splits,
        CHUNKS=bool(chunks), C_QUERIES=c_queries, C_BLOCK_H=c_block_h, C_BLOCK_M=c_block_m,
        ZERO_PADDING=zero_padding, ROPE=rope is not None, HALF=head_dim // 2,
        FP8=fp8, FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0,
        ROUND_BITS=fp8_round_bits(k_cache.dtype) if fp8 and q.device.type == "cpu" else 0,
        num_warps=4 if max(d_block_m, c_block_m if chunks else 0) * block_d <= ACCUMULATOR // 2 else 8,
    )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: QueryRows,
                    queries_per_row: int, block_table: torch.Tensor, scale: float, sliding_window: int | None,
                    out: torch.Tensor, splits: int | None = None, min_span: int = MIN_SPAN,
                    kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One row group's `attention` (every real row at most `queries_per_row` tokens long) written into out; other
    tokens of out are left alone."""
    if splits is not None:
        assert splits == 1 or queries_per_row == 1, "only decode rows split their keys"
    return attention(q, k_cache, v_cache, [(rows, queries_per_row)], block_table, scale, sliding_window,
                     out=out, splits=splits, min_span=min_span, kv_scales=kv_scales)
