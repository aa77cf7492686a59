"""Service classes in the engine: latency-sensitive work preempts best-effort work at step granularity, TPOT SLOs
cap the step, and best-effort work yields pages (rotated out, then back) without losing its tokens."""

from __future__ import annotations

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core.sampler import SamplerFeatures
from blink.shared.service_class import ServiceClass

LS, BE = ServiceClass.LATENCY_SENSITIVE, ServiceClass.BEST_EFFORT
GREEDY = SamplerFeatures(penalties=False, filtering=False, random=False, logprobs=False)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_until_done(driver, first_token_of: str | None = None):
    """Steps until every request finished; returns each request's tokens and finish, and the step (counted from
    the first one run here) that produced `first_token_of`'s first token."""
    outputs, first, steps = {}, None, 0
    while driver.has_work():
        steps += 1
        for e in driver.step():
            tokens, _ = outputs.get(e.request_id, ([], None))
            outputs[e.request_id] = (tokens + ([e.token] if e.token is not None else []), e.finish_reason)
            if e.request_id == first_token_of and first is None and e.token is not None:
                first = steps
    return outputs, first


# QLLM's setting is a mixture of experts: the classes must work unchanged on one.
KINDS = ["qwen3", "qwen3-moe"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_pages", [400, 60], ids=["roomy-pool", "tight-pool"])
@pytest.mark.parametrize("policy", ["slo", "fcfs"])
def test_latency_sensitive_request_starts_within_two_steps_of_arriving(checkpoint, policy, num_pages, kind):
    llm = LLM(str(checkpoint(kind)), max_num_seqs=8, max_num_batched_tokens=64, num_pages=num_pages, page_size=8,
              max_model_len=256, scheduling_policy=policy)
    driver = llm._driver
    best_effort = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, service_class=BE)
    for i in range(6):
        driver.add_request(f"be{i}", _prompt(150, i), best_effort, 20)
    for _ in range(2):
        driver.step()  # the best-effort prefills fill the 64-token budget
    urgent = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, service_class=LS)
    driver.add_request("ls", _prompt(30, 99), urgent, 5)
    outputs, first = _run_until_done(driver, first_token_of="ls")

    expected = {f"be{i}": o.token_ids for i, o in enumerate(llm.generate([_prompt(150, i) for i in range(6)],
                                                                         best_effort))}
    assert {r: tokens for r, (tokens, _) in outputs.items() if r != "ls"} == expected  # nothing lost
    assert outputs["ls"][1] == "length" and len(outputs["ls"][0]) == 5
    if policy == "slo":
        assert first <= 2
    else:  # first come, first served: it waits behind 900 tokens of best-effort prefill
        assert first > 5
    assert int(llm.engine.pool.num_free) == llm.engine.pool.usable_pages


def test_tight_tpot_slo_caps_the_step_tokens(checkpoint):
    llm = LLM(str(checkpoint("qwen3")), max_num_seqs=4, max_num_batched_tokens=256, num_pages=200, page_size=8,
              max_model_len=256)
    driver, step = llm._driver, llm.engine.step

    def tokens_next_to_a_decode(tpot_slo_ms: float | None) -> int:
        decoding = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, tpot_slo_ms=tpot_slo_ms)
        driver.add_request("decoding", _prompt(10, 1), decoding, 50)
        driver.step()  # its prefill: it decodes from now on
        driver.add_request("long", _prompt(240, 2), SamplingParams(temperature=0, max_tokens=1), 1)
        driver._fill_slots()
        step.cost.fit.copy_(torch.tensor([0.010, 0.001], dtype=torch.float64))  # 10 ms + 1 ms per token
        live = step.plan(GREEDY, llm.engine.mirror).read_sizes().tokens
        driver.abort_all()
        _run_until_done(driver)
        return live

    assert tokens_next_to_a_decode(None) == 241  # the decode and the whole prompt
    # 30 ms per token leaves 20 tokens by the model; the cap never goes below 64.
    assert tokens_next_to_a_decode(30.0) == 64
    assert tokens_next_to_a_decode(200.0) == 190


@pytest.mark.parametrize("kind", KINDS)
def test_best_effort_yields_pages_longest_running_first_and_gets_them_back(checkpoint, kind):
    """Best-effort requests fill the pool; a latency-sensitive one takes pages from those the pool cannot keep in
    precedence order, the longest-running of them first (rotated out, not recomputed); they complete intact."""
    llm = LLM(str(checkpoint(kind)), max_num_seqs=6, max_num_batched_tokens=128, num_pages=33, page_size=8,
              max_model_len=256)
    driver, state, mirror = llm._driver, llm.engine.state, llm.engine.mirror
    names, lengths = ["be1", "be2", "be0", "be3"], [(48, 30), (48, 30), (48, 40), (16, 8)]
    prompts = [_prompt(n, 10 + i) for i, (n, _) in enumerate(lengths)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, service_class=BE) for _, m in lengths]
    for name, prompt, p in zip(names[:3], prompts, params, strict=False):
        driver.add_request(name, prompt, p, p.max_tokens)
    tokens: dict[str, list[int]] = {}

    def step():
        events = driver.step()
        for e in events:
            tokens.setdefault(e.request_id, []).extend([e.token] if e.token is not None else [])
        return events

    for _ in range(10):
        step()
    driver.add_request("be3", prompts[3], params[3], params[3].max_tokens)  # has run least when pages run out
    step()
    driver.add_request("ls", _prompt(100, 5), SamplingParams(temperature=0, max_tokens=4, service_class=LS), 4)
    driver._fill_slots()
    slot_of = {p.request_id: s for s, p in driver._resident.items()}
    # Its 13 pages fit once be0 and be3 give theirs (behind be1 and be2 in precedence); be0's 8 are enough.
    assert any(e.request_id == "ls" for e in step())  # its prefill ran at once, on pages be0 gave
    assert int(state.pages_out[slot_of["be0"]]) > 0 and int(state.pages_out[slot_of["be3"]]) == 0
    while driver.has_work():
        step()
    out, back = mirror.pages_moved.tolist()
    assert out > 0 and out == back and int(mirror.free.num_free) == mirror.num_pages - 1
    assert int(state.num_recomputes) == 0 < int(state.num_preemptions)  # rotated, never recomputed
    expected = llm.generate(prompts, params)
    assert [tokens[name] for name in names] == [o.token_ids for o in expected]
