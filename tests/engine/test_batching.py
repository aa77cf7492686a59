"""Continuous batching: batch invariance, memory pressure and preemption, priorities."""

from __future__ import annotations

import pytest
import torch

from blink.engine import LLM, SamplingParams


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1174, (int(length),), generator=gen).tolist()
            for length in torch.randint(4, 60, (n,), generator=gen)]


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3-moe"])  # a mixture of experts routes each token alone too
def test_same_tokens_alone_and_in_a_batch_of_16(checkpoint, kind):
    llm = LLM(str(checkpoint(kind)), max_num_seqs=16, max_num_batched_tokens=64, num_pages=400)
    prompts = _prompts(16)
    for params in (SamplingParams(temperature=0, max_tokens=20),
                   SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=99, max_tokens=20)):
        batch = llm.generate(prompts, params)
        for prompt, together in zip(prompts[:4], batch, strict=False):
            alone = llm.generate([prompt], params)[0]
            assert alone.token_ids == together.token_ids


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3-moe"])
@pytest.mark.parametrize("swap_space", [0, 1], ids=["recompute", "rotation"])
def test_small_page_pool_completes_every_request_with_the_same_tokens(checkpoint, swap_space, kind):
    model_dir = str(checkpoint(kind))
    prompts = _prompts(12, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40)
    roomy = LLM(model_dir, max_num_seqs=12, max_num_batched_tokens=64, num_pages=400).generate(prompts, params)

    # 13 pages of 8 tokens hold 104 tokens: less than two full sequences of up to 99 tokens.
    tight_llm = LLM(model_dir, max_num_seqs=12, max_num_batched_tokens=64, num_pages=14, page_size=8,
                    max_model_len=104, swap_space=swap_space)
    tight = tight_llm.generate(prompts, params)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in tight)
    engine = tight_llm.engine
    if swap_space:  # rotated out and back in, never recomputed
        out, back = engine.mirror.pages_moved.tolist()
        assert out > 0 and back == out and int(engine.state.num_recomputes) == 0
        assert int(engine.mirror.free.num_free) == engine.mirror.num_pages - 1
    else:
        assert engine.mirror is None and int(engine.state.num_preemptions) > 0
    assert int(engine.pool.num_free) == engine.pool.usable_pages  # every page came back


def test_preemption_evicts_lowest_priority_first(checkpoint):
    """With room for one sequence at a time, the high-priority request runs straight through."""
    llm = LLM(str(checkpoint("llama-gqa")), max_num_seqs=4, max_num_batched_tokens=16, num_pages=9,
              page_size=8, max_model_len=64)
    prompts = _prompts(3, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=30, priority=p) for p in (5, 0, 5)]
    order = []
    driver = llm._driver
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        driver.add_request(str(i), prompt, p, 30)
    while driver.has_work():
        order += [e.request_id for e in driver.step() if e.finish_reason]
    assert order[0] == "1"
    assert sorted(order) == ["0", "1", "2"]


def test_requests_admitted_in_one_step_keep_their_queue_order(checkpoint):
    """First come, first served among requests that take their slots in the same step: with a budget that fits
    one prompt a step, the one queued first gets its first token first, whichever slot it lands in (the free
    slots go back in the order their requests finished)."""
    llm = LLM(str(checkpoint("llama-gqa")), max_num_seqs=2, max_num_batched_tokens=16, page_size=4,
              max_model_len=48, num_pages=40, scheduling_policy="fcfs")
    driver, first_token = llm._driver, {}
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for name, length in (("A", 6), ("B", 6), ("C", 13), ("D", 13)):
        driver.add_request(name, list(range(5, 5 + length)), params, 2)
    step = 0
    while driver.has_work():
        step += 1
        for e in driver.step():
            first_token.setdefault(e.request_id, step)
    assert first_token["A"] <= first_token["B"] < first_token["C"] < first_token["D"]
