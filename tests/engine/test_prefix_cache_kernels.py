"""Prefix caching's Triton kernels (blink.engine.kernels.page_release's KERNELS: allocate, release, reuse, register;
in Triton's interpreter, programs in order) leave the cache exactly as the torch reference (PrefixCache's methods)
does, every tensor of it, through random churn over shared prefixes: hits, registrations, releases of slots sharing
pages, evictions of the oldest cached pages, the ring compacted, and a ring overfilled by releases with no
allocation between them. Plus what the structures promise: the cached pages are found, nothing is lost or doubled."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernels

import random

import pytest
import torch

from blink.engine.core.kv_cache import NULL_PAGE
from blink.engine.core.prefix_cache import NO_CLAIM, PrefixCache
from blink.engine.kernels.page_release import KERNELS
from blink.shared.prefix_hash import page_hashes

S, PAGE, H = 5, 4, 8
WIDTH = H + 2  # a prompt's pages, one more, and the trash column


class Pair:
    """The same cache, slots and calls twice: the reference's and the kernels'."""

    def __init__(self, pages: int):
        self.caches = [PrefixCache(pages, PAGE, torch.device("cpu")) for _ in range(2)]
        self.caches[1].kernels = KERNELS
        self.tables = [torch.zeros(S, WIDTH, dtype=torch.int64) for _ in range(2)]
        self.held = [torch.zeros(S, dtype=torch.int64) for _ in range(2)]
        self.computed = [torch.zeros(S, dtype=torch.int64) for _ in range(2)]

    def reuse(self, hashes, prompt_len, which):
        found = [c.reuse(hashes, prompt_len, which, t, h, n)
                 for c, t, h, n in zip(self.caches, self.tables, self.held, self.computed, strict=True)]
        assert torch.equal(*found)
        return found[0]

    def allocate(self, need, max_new):
        for c, t, h in zip(self.caches, self.tables, self.held, strict=True):
            c.allocate(need, t, h, max_new)

    def register(self, hashes, prompt_len, before, after, max_new):
        for c, t in zip(self.caches, self.tables, strict=True):
            c.register(hashes, prompt_len, before, after, t, max_new)

    def release(self, which):
        for c, t, h in zip(self.caches, self.tables, self.held, strict=True):
            c.release(which, t, h)
        for n in self.computed:
            n.masked_fill_(which, 0)

    def check(self, what: str) -> None:
        want, got = self.caches
        N, R, T = want.num_pages, want.ring_size, want.table_size
        for name, a, b in [("refs", want.refs, got.refs), ("hash", want.hash, got.hash),
                           ("num_free", want.num_free, got.num_free), ("empties", want.empties, got.empties),
                           ("stack", want.stack[:N - 1], got.stack[:N - 1]), ("head", want.head, got.head),
                           ("tail", want.tail, got.tail), ("ring", want.ring[:R], got.ring[:R]),
                           ("pos", want.pos, got.pos), ("slots", want.slots[:T], got.slots[:T]),
                           ("table", self.tables[0][:, :-1], self.tables[1][:, :-1]),
                           ("held", *self.held), ("computed", *self.computed)]:
            assert torch.equal(a, b), f"{what}: {name}\n{a}\n{b}"
        assert bool((got.claims == NO_CLAIM).all()), what
        # What the structures promise: a page is free once, on the stack or live in the ring as its hash says.
        free = set(range(1, N)) - set(want.refs.nonzero()[:, 0].tolist())
        assert int(want.num_free) == len(free)
        stacked = want.stack[: int(want.empties)].tolist()
        counters = range(int(want.head), min(int(want.tail), int(want.head) + R))
        ringed = [int(want.ring[c % R]) for c in counters if int(want.pos[want.ring[c % R]]) == c
                  and int(want.refs[want.ring[c % R]]) == 0]
        assert sorted(stacked + ringed) == sorted(free), what
        assert all(int(want.hash[p]) == 0 for p in stacked) and all(int(want.hash[p]) != 0 for p in ringed), what


def _churn(rng: random.Random, pair: Pair, steps: int, allocate: bool = True) -> int:
    """Random requests over a few shared prefixes: start (hit, pages for the rest, registered), grow, finish.
    Returns the tokens found in the cache."""
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randint(4, H * PAGE))] for _ in range(3)]
    prompt_len = torch.zeros(S, dtype=torch.int64)
    hashes = torch.zeros(S, H, dtype=torch.int64)
    hits = 0
    for step in range(steps):
        cache, held, computed = pair.caches[0], pair.held[0], pair.computed[0]
        idle = (held == 0) & (computed == 0)
        starting = torch.tensor([bool(idle[s]) and rng.random() < 0.6 for s in range(S)])
        for s in starting.nonzero()[:, 0].tolist():
            prompt = (rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randint(0, 8))])
            prompt = prompt[: rng.randint(1, H * PAGE)]
            prompt_len[s] = len(prompt)
            row = page_hashes(prompt, PAGE, seed=7)
            hashes[s] = torch.tensor(row + [0] * (H - len(row)))
        found = pair.reuse(hashes, prompt_len, starting)
        hits += int(found.sum())
        pair.check(f"step {step}: reuse")
        if allocate:  # pages for what each slot computes next (its prompt's rest, or one more page), while they fit
            target = torch.where(computed < prompt_len, (prompt_len + PAGE - 1) // PAGE, held + 1).clamp(max=H + 1)
            want = torch.where((held > 0) | starting, target - held, 0).clamp(min=0)
            fits = want.cumsum(0) <= cache.num_free
            need = torch.where(fits, want, 0)
            max_new = int(need.max()) if rng.random() < 0.5 else H + 1
            pair.allocate(need, max_new)
            pair.check(f"step {step}: allocate")
            before = computed.clone()
            for n in pair.computed:
                n.copy_(torch.where(need > 0, torch.minimum(pair.held[0] * PAGE, prompt_len.clamp(min=1)), n))
            pair.register(hashes, prompt_len, before, computed, max_new=H + 1)
            pair.check(f"step {step}: register")
        done = torch.tensor([bool(held[s] > 0) and rng.random() < 0.3 for s in range(S)])
        pair.release(done)
        pair.check(f"step {step}: release")
    return hits


@pytest.mark.parametrize("seed", range(4))
def test_the_kernels_leave_the_cache_as_the_reference_does(seed):
    pair = Pair(pages=24)  # a ring of 128 entries: compacted past 64
    hits = _churn(random.Random(seed), pair, steps=40)
    assert hits > 0  # prefixes were found
    assert int(pair.caches[0].tail) > 64 or int(pair.caches[0].head) > 0  # the ring was used


def _cache_a_prefix(pair: Pair, hashes: torch.Tensor, prompt_len: torch.Tensor) -> torch.Tensor:
    """Slot 0 computes its 13-token prompt (4 pages), registers its 3 full pages and finishes: they stay cached.
    Returns the mask of slot 0."""
    one = torch.tensor([True] + [False] * (S - 1))
    pair.allocate(torch.tensor([4, 0, 0, 0, 0]), max_new=4)
    for n in pair.computed:
        n[0] = 13
    pair.register(hashes, prompt_len, torch.zeros(S, dtype=torch.int64), pair.computed[0], max_new=4)
    pair.release(one)
    return one


@pytest.mark.parametrize("cycles", [6, 12])
def test_dead_ring_entries_are_compacted_and_an_overfull_ring_forgets(cycles):
    """A cached prefix found and released again and again leaves a dead entry per page each time: 6 cycles take a
    ring of 32 past half (the next allocation compacts it), 12 past full (the pages released last forget their
    hashes, onto the stack)."""
    pair = Pair(pages=8)  # pages 1..7, a ring of 32
    hashes = torch.zeros(S, H, dtype=torch.int64)
    hashes[0, :3] = torch.tensor(page_hashes(list(range(1, 14)), PAGE, seed=1))
    prompt_len = torch.tensor([13] + [0] * (S - 1))
    one = _cache_a_prefix(pair, hashes, prompt_len)
    for cycle in range(cycles):
        assert pair.reuse(hashes, prompt_len, one).tolist()[0] == 12 or cycles > 10, cycle
        pair.check(f"cycle {cycle}: reuse")
        pair.release(one)
        pair.check(f"cycle {cycle}: release")
    cache = pair.caches[0]
    span = int(cache.tail - cache.head)
    assert span > cache.ring_size // 2
    forgot = int((cache.hash != 0).sum()) < 3
    assert forgot == (cycles > 10)
    pair.allocate(torch.tensor([0, 1, 0, 0, 0]), max_new=1)
    pair.check("allocated")
    assert int(cache.tail - cache.head) <= 3  # compacted: the live entries alone


def test_a_registered_prefix_is_found_and_evicted_oldest_first():
    pair = Pair(pages=6)  # pages 1..5
    prompt = list(range(1, 13))  # 3 full pages
    hashes = torch.zeros(S, H, dtype=torch.int64)
    hashes[0, :3] = torch.tensor(page_hashes(prompt, PAGE, seed=1))
    prompt_len = torch.zeros(S, dtype=torch.int64)
    prompt_len[0] = 12
    one = torch.tensor([True] + [False] * (S - 1))
    pair.allocate(torch.tensor([3, 0, 0, 0, 0]), max_new=3)
    owned = pair.tables[0][0, :3].tolist()
    for n in pair.computed:
        n[0] = 12
    pair.register(hashes, prompt_len, torch.zeros(S, dtype=torch.int64), pair.computed[0], max_new=3)
    pair.release(one)
    pair.check("released")
    pair.allocate(torch.tensor([0, 3, 0, 0, 0]), max_new=3)  # the 2 empty pages, then the last page released
    assert pair.tables[0][1, :3].tolist()[2] == owned[2]
    found = pair.reuse(hashes, prompt_len, one)
    assert found.tolist() == [8, 0, 0, 0, 0] and pair.tables[0][0, :2].tolist() == owned[:2]
    pair.check("found")
    assert pair.caches[0].table_size >= 4 * 6 and int(pair.caches[0].refs[NULL_PAGE]) == 1


def test_the_plans_reuse_is_one_launch_that_does_what_the_reference_does():
    """scheduler._reuse_prefix and its one launch (blink.engine.kernels.prefix_cache.reuse_prefix) leave the slots
    and the cache alike: every starting slot shares one cached prefix, but one that asks for its prompt's logprobs
    takes nothing, a first start records what it found as its cached tokens, and a start after a preemption takes
    the pages but keeps its first start's figure."""
    from types import SimpleNamespace

    from blink.engine.core.scheduler import _reuse_prefix
    from blink.engine.kernels.prefix_cache import reuse_prefix

    pair = Pair(pages=24)
    hashes = torch.zeros(S, H, dtype=torch.int64)
    hashes[:, :3] = torch.tensor(page_hashes(list(range(1, 14)), PAGE, seed=1))
    prompt_len = torch.full((S,), 13)
    _cache_a_prefix(pair, hashes, prompt_len)
    states = [SimpleNamespace(page_hashes=hashes, prompt_len=prompt_len, block_table=table, pages_held=held,
                              num_computed=computed, prompt_logprobs=torch.tensor([-1, 0, -1, -1, -1]),
                              preemptions=torch.tensor([0, 0, 2, 0, 0]), cached_tokens=torch.full((S,), 7))
              for table, held, computed in zip(pair.tables, pair.held, pair.computed, strict=True)]
    starting = torch.tensor([True, True, True, False, True])
    for reuse, state, cache in zip((_reuse_prefix, reuse_prefix), states, pair.caches, strict=True):
        reuse(state, cache, starting)
    pair.check("reused")
    want, got = states
    assert torch.equal(want.cached_tokens, got.cached_tokens)
    assert want.cached_tokens.tolist() == [12, 7, 7, 7, 12] and want.num_computed.tolist() == [12, 0, 12, 0, 12]
