"""Randomised workloads under a tight page pool: every request completes, exactly as with ample memory."""

from __future__ import annotations

import random

import pytest

from blink.engine import LLM, SamplingParams
from blink.engine.state import SlotStatus


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
