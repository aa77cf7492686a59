"""Inputs for the attention and rope kernels' tests (tests/engine/test_kernels.py, tests/engine/test_cpu_kernels.py):
a step over random paged caches, and rope's cos/sin tables."""

from __future__ import annotations

import torch

from blink.engine.core.scheduler import QUERY_BLOCK, QueryRows

# The kernels run compiled on a GPU and in Triton's interpreter without one (conftest): inputs are drawn on the CPU
# (the same numbers either way) and moved to where the kernels run.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (tokens already in the cache, tokens computed this step) per sequence: decodes (1), a prompt's first chunk longer
# than QUERY_BLOCK, chunks that continue a long context, a two-token chunk, and rows ending on page boundaries.
SEQUENCES = [(37, 1), (0, 70), (5, 1), (100, 20), (0, 2), (63, 1), (64, 1), (15, 65)]


def _rows(runs: list[tuple[int, int, int, int]], capacity: int, batch: int, gen: torch.Generator) -> QueryRows:
    """runs: (start, length, first_pos, slot) of the real rows; the rest of the capacity holds plausible junk that a
    kernel reading past `count` would attend with."""
    junk = capacity - len(runs)
    start = torch.tensor([r[0] for r in runs] + torch.randint(0, batch, (junk,), generator=gen).tolist())
    length = torch.tensor([r[1] for r in runs] + [1] * junk)
    first_pos = torch.tensor([r[2] for r in runs] + torch.randint(0, 8, (junk,), generator=gen).tolist())
    slot = torch.tensor([r[3] for r in runs] + [0] * junk)
    return QueryRows(*(t.to(DEVICE) for t in (start, length, first_pos, slot, torch.tensor(len(runs)))))


def scene(sequences, page_size, kv_heads, group, head_dim, dtype, padding=3, seed=0):
    """A step over random caches: q, k and v of every batch token, where their K/V go, and the two row groups."""
    gen = torch.Generator().manual_seed(seed)
    S = len(sequences)
    pages_per_seq = max(-(-(done + take) // page_size) for done, take in sequences)
    num_pages = S * pages_per_seq + 3
    table = torch.zeros(S, pages_per_seq + 1, dtype=torch.int64)
    shuffled = torch.randperm(num_pages - 1, generator=gen) + 1  # page 0 is the null page
    for s in range(S):
        table[s, :pages_per_seq] = shuffled[s * pages_per_seq:(s + 1) * pages_per_seq]
    B = sum(take for _, take in sequences) + padding
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(B, kv_heads * group, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(B, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    write_rows = torch.zeros(B, dtype=torch.int64)
    decodes, chunks, start = [], [], 0
    for s, (done, take) in enumerate(sequences):
        pos = torch.arange(done, done + take)
        write_rows[start:start + take] = table[s, pos // page_size] * page_size + pos % page_size
        if take == 1:
            decodes.append((start, 1, done, s))
        for j in range(0, take if take > 1 else 0, QUERY_BLOCK):
            chunks.append((start + j, min(QUERY_BLOCK, take - j), done + j, s))
        start += take
    decode_rows = _rows(decodes, len(decodes) + 2, B, gen)
    chunk_rows = _rows(chunks, len(chunks) + 2, B, gen)
    inputs = (q, k, v, k_cache, v_cache, table, write_rows)
    return (*(t.to(DEVICE) for t in inputs), decode_rows, chunk_rows)


def rope_tables(max_len: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_len).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
