"""Prefix caching: the page hashes requests carry, and the engine reusing cached KV pages (the host mode here; the
device step in tests/engine/test_device_step.py): the same tokens with and without a hit, the hits counted,
reference counts right through preemption, rotation and cancellation."""

from __future__ import annotations

import random

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core.kv_cache import NULL_PAGE
from blink.engine.core.state import SlotStatus
from blink.shared.prefix_hash import page_hashes
from blink.shared.service_class import ServiceClass
from tests.support.churn import assert_ended_as, churn

SHAPE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=96)
PROMPT = list(range(10, 60))  # 50 tokens: 6 full pages of 8 and 2 tokens


def test_page_hashes_name_whole_prefixes():
    a = page_hashes(PROMPT, 8, seed=1)
    assert len(a) == 6 and all(h > 0 for h in a)
    assert page_hashes([*PROMPT[:40], 1, 2, 3], 8, seed=1) == a[:5]  # a page's hash covers everything before it
    assert page_hashes([99, *PROMPT[1:]], 8, seed=1)[5] != a[5]  # ... the first page too
    assert page_hashes(PROMPT, 8, seed=2)[0] != a[0]  # the engine's seed, its salt and the page size are roots
    assert page_hashes(PROMPT, 8, seed=1, cache_salt="tenant")[0] != a[0]
    assert page_hashes(PROMPT, 16, seed=1)[0] != a[1]
    assert page_hashes(PROMPT[:7], 8, seed=1) == []  # no full page, no hash


@pytest.fixture(scope="module")
def engines(checkpoint):
    model = str(checkpoint("qwen3"))
    return LLM(model, num_pages=64, **SHAPE), LLM(model, num_pages=64, enable_prefix_caching=False, **SHAPE)


def test_a_cached_prefix_gives_the_tokens_computing_it_gives(engines):
    cached, plain = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=8, ignore_eos=True)
    # The prompt, again; a shared prefix with another tail; a prefix ending mid-page; the whole prompt with a
    # sampled continuation; a prompt of whole pages (its last token is computed: 40 cached of 48).
    rounds = [[PROMPT], [PROMPT], [[*PROMPT[:40], 7, 7, 7]], [PROMPT[:21]], [[*PROMPT, 3]], [PROMPT[:48]]]
    hits = []
    for prompts in rounds:
        for params in (greedy, seeded):
            got, want = cached.generate(prompts, params), plain.generate(prompts, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            hits.append(got[0].num_cached_tokens)
            assert want[0].num_cached_tokens == 0
    assert hits == [0, 48, 48, 48, 40, 40, 16, 16, 48, 48, 40, 40]


def test_prompt_logprobs_are_computed_not_cached(engines):
    cached, plain = engines
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    cached.generate([PROMPT], SamplingParams(max_tokens=1))
    got, want = cached.generate([PROMPT], params)[0], plain.generate([PROMPT], params)[0]
    assert got.num_cached_tokens == 0 and got.token_ids == want.token_ids
    assert got.prompt_logprobs == pytest.approx(want.prompt_logprobs)


def test_a_prefix_outlives_its_owner_s_preemption(checkpoint):
    """A best-effort request whose pages a latency-sensitive one takes (recomputed: no host mirror) leaves its
    prompt's pages cached: it finds them when it starts over, and so does a later request with the same prompt."""
    model = str(checkpoint("qwen3"))
    tight = LLM(model, num_pages=14, swap_space=0, **SHAPE)  # 13 pages: the owner's 7, the intruder's 9 do not fit
    be = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, service_class=ServiceClass.BEST_EFFORT)
    ls = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    driver, state = tight._driver, tight.engine.state
    driver.add_request("owner", PROMPT, be, 6)
    tokens: dict[str, list[int]] = {}
    stats = {}

    def run(steps: int | None = None) -> None:
        while driver.has_work() and (steps is None or steps > 0):
            for e in driver.step():
                tokens.setdefault(e.request_id, []).extend([e.token] if e.token is not None else [])
                if e.stats is not None:
                    stats[e.request_id] = e.stats
            steps = None if steps is None else steps - 1

    run(steps=3)  # the owner's prompt is computed and it decodes
    driver.add_request("intruder", list(range(200, 270)), ls, 8)
    driver.add_request("again", PROMPT, be, 6)
    run()
    assert stats["owner"].preemptions >= 1 and stats["owner"].cached_tokens == 0
    assert stats["again"].cached_tokens == 48
    assert int(state.num_recomputes) >= 1
    roomy = LLM(model, num_pages=64, enable_prefix_caching=False, **SHAPE)
    want = roomy.generate([PROMPT, list(range(200, 270))], [be, ls])
    assert tokens["owner"] == tokens["again"] == want[0].token_ids and tokens["intruder"] == want[1].token_ids


def _check_pages(engine, contents: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every page's reference count is the block-table entries mapping it; the free count is the pages nobody
    maps; a page with a hash holds what the first page seen with that hash held."""
    state, pool, cache = engine.state, engine.pool, engine.pool.prefix_cache
    resident = (state.status == SlotStatus.RUNNING) & ~state.rotated
    held = torch.arange(state.block_table.shape[1]) < state.pages_held[:, None]
    mapped = state.block_table[held & resident[:, None]]
    assert int(state.pages_held[~resident].sum()) == 0
    refs = torch.bincount(mapped, minlength=pool.num_pages)
    assert torch.equal(cache.refs[1:], refs[1:]) and int(refs[NULL_PAGE]) == 0
    assert int(pool.num_free) == int((refs[1:] == 0).sum())
    for page in cache.hash.nonzero()[:, 0].tolist():
        kv = (pool.k[:, page].clone(), pool.v[:, page].clone())
        first = contents.setdefault(int(cache.hash[page]), kv)
        assert torch.allclose(first[0], kv[0], atol=1e-5) and torch.allclose(first[1], kv[1], atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_random_sharing_churn_keeps_every_reference(checkpoint, seed):
    """Random arrivals of prompts built from a few shared prefixes, both classes, cancellations, a pool far too
    small and a host mirror that fills: after every step no page is leaked, none is free while mapped, no cached
    page holds other contents; uncancelled requests end with the tokens of an engine with room and no cache."""
    from blink.engine.core.kv_cache import PagePool

    model = str(checkpoint("qwen3"))
    shape = dict(SHAPE, max_num_seqs=8, max_num_batched_tokens=48)
    roomy = LLM(model, num_pages=200, enable_prefix_caching=False, **shape)
    page_bytes = PagePool.bytes_per_page(roomy.engine.model_config, 8)
    tight = LLM(model, num_pages=16, swap_space=4 * page_bytes / 2**30, **shape)  # a mirror of 3 pages
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 1000) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    prompts, params = [], []
    for _ in range(rng.randint(14, 22)):
        tail = [rng.randrange(1, 1000) for _ in range(rng.randint(0, 12))]
        prompts.append((rng.choice(prefixes) + tail)[: rng.randint(9, 56)] or [1])
        params.append(SamplingParams(max_tokens=rng.randint(1, 20), temperature=rng.choice([0.0, 0.9]),
                                     seed=rng.randrange(1000), service_class=rng.choice(list(ServiceClass))))
    expected = {str(i): o.token_ids for i, o in enumerate(roomy.generate(prompts, params))}

    contents = {}
    churned = churn(tight._driver, prompts, params, rng, lambda: _check_pages(tight.engine, contents))
    assert_ended_as(churned, expected)
    assert churned.cached_tokens > 0  # prefixes were shared
    assert int(tight.engine.pool.num_free) == tight.engine.pool.usable_pages


def test_allocation_takes_empty_pages_then_the_least_recently_released_tails_first():
    from blink.engine.core.prefix_cache import PrefixCache

    cache = PrefixCache(num_pages=6, page_size=4, device=torch.device("cpu"))  # pages 1..5
    table, held = torch.zeros(2, 5, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    cache.allocate(torch.tensor([3, 0]), table, held, max_new=3)
    owned = table[0, :3].tolist()
    hashes = torch.tensor([[11, 12, 13, 0], [0, 0, 0, 0]])
    cache.register(hashes, torch.tensor([12, 0]), torch.tensor([0, 0]), torch.tensor([12, 0]), table, max_new=4)
    cache.release(torch.tensor([True, False]), table, held)
    assert int(cache.num_free) == 5 and sorted(cache.hash.tolist()) == [0, 0, 0, 11, 12, 13]
    cache.allocate(torch.tensor([0, 2]), table, held, max_new=3)  # the two pages that never held anything
    assert not set(table[1, :2].tolist()) & set(owned)
    cache.allocate(torch.tensor([0, 1]), table, held, max_new=3)  # then the released request's last page
    assert table[1, 2].item() == owned[2] and sorted(cache.hash.tolist()) == [0, 0, 0, 0, 11, 12]
    found = cache.reuse(hashes, torch.tensor([12, 0]), torch.tensor([True, False]), table, held,
                        torch.zeros(2, dtype=torch.int64))
    assert found.tolist() == [8, 0] and table[0, :2].tolist() == owned[:2] and int(cache.num_free) == 0


@pytest.mark.parametrize("bookkeeping", ["torch", "cpu"])
@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_only_requests_whose_pages_would_free_are_preempted(checkpoint, policy, bookkeeping):
    """A request that has just mapped a shared prefix holds only pages the requests kept running map too: giving
    them back frees nothing, so it is not evicted (rotated out, a preemption counted) for pages it cannot give. Held
    to the reference's make_room and to the CPU's C++ twin."""
    import dataclasses

    from blink.engine.core import paging
    from blink.engine.core.bookkeeping import TORCH_BOOKKEEPING
    from blink.engine.core.kv_cache import PagePool

    evictions = []

    def watched(make_room):
        def room(state, pool, policy, take, resident, precedence, mirror):
            held = torch.arange(state.block_table.shape[1])[None, :] < state.pages_held[:, None]
            tables = [set(state.block_table[s][held[s]].tolist()) for s in range(state.num_slots)]
            planned = make_room(state, pool, policy, take, resident, precedence, mirror)
            evicted = planned[2].tolist()
            for s in (s for s, gone in enumerate(evicted) if gone):
                still_mapped = set().union(*(t for o, t in enumerate(tables) if not evicted[o]))
                evictions.append(bool(tables[s] - still_mapped))
            return planned
        return room

    model, rng = str(checkpoint("qwen3")), random.Random(0)
    shape = dict(max_num_seqs=4, max_num_batched_tokens=8, page_size=4, max_model_len=48, scheduling_policy=policy)
    page_bytes = PagePool.bytes_per_page(LLM(model, num_pages=20, **shape).engine.model_config, 4)
    tight = LLM(model, num_pages=16, swap_space=10.5 * page_bytes / 2**30, **shape)
    step = tight.engine.step
    if bookkeeping == "torch":
        step.use(TORCH_BOOKKEEPING)
    elif step.plan_kernels.make_room is None:
        pytest.skip("the CPU kernel set (its C++ make_room) is not what this engine runs")
    step.plan_kernels = dataclasses.replace(step.plan_kernels,
                                            make_room=watched(step.plan_kernels.make_room or paging.make_room))
    prefix = [rng.randrange(1, 1000) for _ in range(16)]
    prompts = [prefix + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 12))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(4, 16), temperature=0.0, ignore_eos=True,
                             service_class=rng.choice(list(ServiceClass))) for _ in prompts]
    roomy = LLM(model, num_pages=200, enable_prefix_caching=False, **shape)
    assert [o.token_ids for o in tight.generate(prompts, params)] == [o.token_ids
                                                                     for o in roomy.generate(prompts, params)]
    assert evictions and all(evictions)  # under pressure, and each eviction gave back a page of its own
