"""Who maps which page as Triton kernels (blink.engine.kernels.page_sharing, in Triton's interpreter) answers as the
torch reference (blink.engine.core.page_sharing) does: whether a slot's pages could free one, and how many pages
have their first or last holder at each position, over slots sharing prefixes (at the same columns, as hits map
them), positions a permutation or partly 'nowhere', call after call (the kernels' scratch back at rest each time)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernels

import random
from types import SimpleNamespace

import torch

from blink.engine.core import page_sharing
from blink.engine.core.prefix_cache import PrefixCache
from blink.engine.kernels.page_release import KERNELS
from blink.engine.kernels.page_sharing import AT_REST

S, PAGES, WIDTH = 7, 64, 9


def _slots(rng: random.Random) -> SimpleNamespace:
    free = list(range(1, PAGES))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(4)]
    table, held = torch.zeros(S, WIDTH + 1, dtype=torch.int64), torch.zeros(S, dtype=torch.int64)
    for s in range(S):
        shared = prefix[:rng.randrange(0, 5)]
        pages = shared + [free.pop() for _ in range(rng.randrange(0, WIDTH - len(shared) + 1))]
        table[s, :len(pages)] = torch.tensor(pages, dtype=torch.int64)
        held[s] = len(pages)
    return SimpleNamespace(block_table=table, pages_held=held, num_slots=S)


def test_the_kernels_count_shared_pages_as_the_reference_does():
    reference, kernels = (PrefixCache(PAGES, 16, torch.device("cpu")) for _ in range(2))
    kernels.kernels = KERNELS
    pools = [SimpleNamespace(prefix_cache=c, num_pages=PAGES) for c in (reference, kernels)]
    answers = set()
    for trial in range(12):
        rng = random.Random(trial)
        state = _slots(rng)
        kept = torch.tensor([rng.random() < 0.5 for _ in range(S)])
        order = torch.tensor(rng.sample(range(S), S))
        nowhere = torch.tensor([rng.random() < 0.3 for _ in range(S)])
        positions = [page_sharing.positions(order), torch.where(nowhere, S, page_sharing.positions(order))]
        want, got = ([page_sharing.frees_a_page(state, pool, page_sharing.held_pages(state, pool), kept)]
                     + [page_sharing.pages_by_position(state, pool, page_sharing.held_pages(state, pool), at, reduce)
                        for at in positions for reduce in ("amin", "amax")] for pool in pools)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g), (trial, w, g)
        assert want[1].sum() > 0
        answers |= set(want[0].tolist())
        assert bool((kernels.extremes[0] == AT_REST["amin"]).all()) and bool((kernels.extremes[1] == -1).all())
    assert answers == {True, False}  # slots that could free a page and slots that could not
