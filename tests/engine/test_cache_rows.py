"""The cache rows kernel (engine/kernels/cache_rows.py) against the torch reference (kernel_sets.write_rows), in
Triton's interpreter without a GPU: each token's page at its slot and position, its offset, and 0 for padding."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from blink.engine.kernels.cache_rows import BLOCK, write_rows
from blink.engine.model import kernel_sets


def test_cache_rows_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    slots, pages, page, B = 5, 9, 16, BLOCK + 37  # two programs, the second partial
    table = torch.randint(1, 100, (slots, pages + 1), generator=gen)
    token_slot = torch.randint(0, slots, (B + 8,), generator=gen)
    token_pos = torch.randint(0, pages * page, (B + 8,), generator=gen)
    token_valid = torch.rand(B + 8, generator=gen) < 0.8
    plan = SimpleNamespace(token_slot=token_slot, token_pos=token_pos, token_valid=token_valid)
    expected = kernel_sets.write_rows(plan, B, table, page)
    got = write_rows(token_slot[:B], token_pos[:B], token_valid[:B], table, page)
    assert torch.equal(got, expected)
    assert bool((got[~token_valid[:B]] == 0).all()) and bool((got[token_valid[:B]] > 0).all())
