"""Randomised workloads under a tight page pool: every request completes, exactly as with ample memory."""

from __future__ import annotations

import random

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core.state import SlotStatus
from tests.support.churn import assert_ended_as, churn


@pytest.fixture(scope="module")
def engines(checkpoint):
    model_dir = str(checkpoint("qwen3"))
    roomy = LLM(model_dir, max_num_seqs=8, max_num_batched_tokens=48, num_pages=200, page_size=8, max_model_len=96)
    tight = LLM(model_dir, max_num_seqs=8, max_num_batched_tokens=48, num_pages=16, page_size=8, max_model_len=96)
    return roomy, tight


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_finish_identically_under_memory_pressure(engines, seed):
    roomy, tight = engines
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(rng.randint(6, 14)):
        prompts.append([rng.randrange(1, 1000) for _ in range(rng.randint(1, 70))])
        params.append(SamplingParams(
            max_tokens=rng.randint(1, 25), priority=rng.randint(-2, 2),
            temperature=rng.choice([0.0, 0.9]), top_k=rng.choice([0, 20]), seed=rng.randrange(1000),
        ))
    expected = roomy.generate(prompts, params)
    got = _generate_checking_pages(tight, prompts, params)
    assert got == {str(i): (o.token_ids, o.finish_reason) for i, o in enumerate(expected)}


def _generate_checking_pages(llm, prompts, params):
    """Runs the requests step by step; after every step only running slots hold pages, and none is lost."""
    driver, state, pool = llm._driver, llm.engine.state, llm.engine.pool
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        driver.add_request(str(i), prompt, p, p.max_tokens)
    outputs = {str(i): ([], None) for i in range(len(prompts))}
    while driver.has_work():
        for event in driver.step():
            tokens, _ = outputs[event.request_id]
            tokens += [event.token] if event.token is not None else []
            outputs[event.request_id] = (tokens, event.finish_reason)
        running = state.status == SlotStatus.RUNNING
        assert int(state.pages_held[~running].sum()) == 0
        assert int(state.pages_held.sum()) + int(pool.num_free) == pool.usable_pages
    assert int(pool.num_free) == pool.usable_pages
    return outputs


@pytest.mark.parametrize("seed", range(3))
def test_churn_with_rotation_loses_and_duplicates_nothing(checkpoint, seed):
    """Random arrivals of both classes, cancellations, a pool far too small and a host mirror that fills:
    requests rotate out and back, some are recomputed; each ends once, uncancelled ones exactly as with room,
    cancelled ones with a prefix of that; no page leaks on either side, after every step."""
    from blink.engine.core.kv_cache import PagePool
    from blink.shared.service_class import ServiceClass

    model_dir = str(checkpoint("qwen3"))
    shape = dict(max_num_seqs=8, max_num_batched_tokens=48, page_size=8, max_model_len=96)
    roomy = LLM(model_dir, num_pages=200, **shape)
    page_bytes = PagePool.bytes_per_page(roomy.engine.model_config, 8)
    tight = LLM(model_dir, num_pages=14, swap_space=4 * page_bytes / 2**30, **shape)  # a mirror of 3 pages
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(rng.randint(14, 22)):
        prompts.append([rng.randrange(1, 1000) for _ in range(rng.randint(1, 60))])
        params.append(SamplingParams(max_tokens=rng.randint(1, 30), temperature=rng.choice([0.0, 0.9]),
                                     seed=rng.randrange(1000), service_class=rng.choice(list(ServiceClass))))
    expected = {str(i): o.token_ids for i, o in enumerate(roomy.generate(prompts, params))}

    state, pool, mirror = tight.engine.state, tight.engine.pool, tight.engine.mirror

    def check() -> None:
        running = state.status == SlotStatus.RUNNING
        assert int(state.pages_held[~running | state.rotated].sum()) == 0
        assert int(state.host_held[~state.rotated].sum()) == 0
        assert int(state.pages_held.sum()) + int(pool.num_free) == pool.usable_pages
        assert int(state.host_held.sum()) + int(mirror.free.num_free) == mirror.num_pages - 1

    assert_ended_as(churn(tight._driver, prompts, params, rng, check), expected)
    out, back = mirror.pages_moved.tolist()
    assert out > 0 and back <= out  # a request cancelled while rotated out never comes back
    assert int(state.num_recomputes) > 0  # the mirror filled: recompute, the last resort
    assert int(pool.num_free) == pool.usable_pages and int(mirror.free.num_free) == mirror.num_pages - 1


def test_a_rotated_request_comes_back_before_later_arrivals_of_its_class(checkpoint):
    """A best-effort request rotated out for a latency-sensitive one must come back before best-effort requests
    that arrived after it, however they keep coming: new ones it precedes wait for it (they had taken the pages it
    needed to come back, step after step, and it starved)."""
    from blink.engine.core.kv_cache import PagePool
    from blink.shared.service_class import ServiceClass

    model_dir = str(checkpoint("qwen3"))
    shape = dict(max_num_seqs=2, max_num_batched_tokens=16, page_size=4, max_model_len=40)
    page_bytes = PagePool.bytes_per_page(LLM(model_dir, num_pages=40, **shape).engine.model_config, 4)
    llm = LLM(model_dir, num_pages=11, swap_space=20 * page_bytes / 2**30, **shape)
    driver, mirror = llm._driver, llm.engine.mirror
    be = dict(temperature=0.0, ignore_eos=True, service_class=ServiceClass.BEST_EFFORT)
    driver.add_request("first", list(range(1, 24)), SamplingParams(max_tokens=10, **be), 10)
    for _ in range(3):
        driver.step()
    driver.add_request("urgent", list(range(3, 33)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), 4)
    finished, later = [], 0
    for _ in range(300):
        if not driver._queue and len(driver._resident) < 2:  # a steady stream of later best-effort arrivals
            driver.add_request(f"later-{later}", [(later * 7 + j) % 40 + 1 for j in range(12)],
                               SamplingParams(max_tokens=6, **be), 6)
            later += 1
        finished += [e.request_id for e in driver.step() if e.finish_reason]
        if "first" in finished:
            break
    assert int(mirror.pages_moved[0]) > 0  # it was rotated out
    assert "first" in finished and not any(r.startswith("later") for r in finished[:finished.index("first")]), finished


def test_the_host_modes_skips_change_no_decision(checkpoint, monkeypatch):
    """The plan and commit skip, eager on the CPU, what an idle part of a step would do for nothing (state.none_set):
    a churn with rotation, recompute, prefix caching and cancels makes the same decisions, step by step, as with
    every part run."""
    from blink.engine.core import commit, scheduler
    from blink.engine.core.kv_cache import PagePool
    from blink.shared.service_class import ServiceClass

    model_dir = str(checkpoint("qwen3"))
    shape = dict(max_num_seqs=8, max_num_batched_tokens=48, page_size=8, max_model_len=96)
    page_bytes = PagePool.bytes_per_page(LLM(model_dir, num_pages=20, **shape).engine.model_config, 8)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 1000) for _ in range(24)] for _ in range(3)]  # shared by some prompts
    prompts = [rng.choice(prefixes)[:rng.randint(0, 24)] + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 36))]
               for _ in range(18)]
    params = [SamplingParams(max_tokens=rng.randint(1, 30), temperature=rng.choice([0.0, 0.9]), seed=i,
                             service_class=rng.choice(list(ServiceClass))) for i in range(18)]

    def run() -> tuple[list, list]:
        llm = LLM(model_dir, num_pages=14, swap_space=4 * page_bytes / 2**30, **shape)
        state, pool, mirror = llm.engine.state, llm.engine.pool, llm.engine.mirror
        steps = []

        def record() -> None:
            # The tables' last column takes masked-off writes: left out.
            steps.append([t.clone() for t in (
                state.block_table[:, :-1], state.pages_held, state.num_computed, state.rotated,
                state.host_table[:, :-1], state.host_held, state.preemptions, state.cached_tokens, pool.num_free,
                mirror.free.num_free, pool.prefix_cache.refs, pool.prefix_cache.hash, mirror.pages_moved,
                state.num_recomputes)])

        churned = churn(llm._driver, prompts, params, random.Random(1), record)
        return [churned.tokens, churned.finishes], steps

    skipping = run()
    for module in (scheduler, commit):
        monkeypatch.setattr(module, "none_set", lambda *masks: False)
    every_part = run()
    assert skipping[0] == every_part[0]
    assert len(skipping[1]) == len(every_part[1])
    for i, (a, b) in enumerate(zip(skipping[1], every_part[1], strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {i}"
    last = every_part[1][-1]
    assert int(last[12][0]) > 0 and int(last[13]) > 0  # it rotated out, and recomputed
    assert any(int(step[7].sum()) > 0 for step in every_part[1])  # prompts found cached pages
