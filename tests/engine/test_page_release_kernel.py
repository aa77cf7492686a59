"""Prefix caching's release kernel (blink.engine.kernels.page_release, in Triton's interpreter) leaves the cache as the
torch reference (PrefixCache.release) does: references, stamps (but the null page's), the clock, the free count, the
block tables; over slots that share a cached prefix (mapped at the same columns, as a hit maps them), some releasing
together, some not."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernel

import random

import torch

from blink.engine.core.prefix_cache import PrefixCache
from blink.engine.kernels import page_release

S, PAGES, WIDTH = 6, 64, 9


def _cache(rng: random.Random) -> tuple[PrefixCache, torch.Tensor, torch.Tensor]:
    cache = PrefixCache(PAGES, 16, torch.device("cpu"))
    free = list(range(1, PAGES))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(3)]
    table, held = torch.zeros(S, WIDTH + 1, dtype=torch.int64), torch.zeros(S, dtype=torch.int64)
    for s in range(S):
        shared = prefix[:rng.randrange(0, 4)]
        pages = shared + [free.pop() for _ in range(rng.randrange(0, WIDTH - len(shared) + 1))]
        table[s, :len(pages)] = torch.tensor(pages, dtype=torch.int64)
        held[s] = len(pages)
        for page in pages:
            cache.refs[page] += 1
    cache.stamp.copy_(torch.tensor([rng.randrange(100) for _ in range(PAGES)]))
    cache.clock.fill_(rng.randrange(5))
    cache.num_free.copy_((cache.refs == 0).sum())
    return cache, table, held


def test_the_kernel_releases_as_the_reference_does():
    for trial in range(10):
        seed = random.Random(trial).randrange(1000)
        (want, want_table, want_held), (got, got_table, got_held) = (_cache(random.Random(seed)) for _ in range(2))
        which = torch.tensor([random.Random(trial + 100).random() < 0.5 for _ in range(S)])
        want.release(which, want_table, want_held)
        page_release.release(got, which, got_table, got_held)
        assert torch.equal(got.refs, want.refs) and torch.equal(got.stamp[1:], want.stamp[1:]), trial
        assert int(got.clock) == int(want.clock) and int(got.num_free) == int(want.num_free), trial
        assert torch.equal(got_table, want_table) and torch.equal(got_held, want_held), trial
