"""Bad requests raise clear errors before anything is queued; stops end requests as asked."""

from __future__ import annotations

import pytest

from blink.engine import LLM, SamplingParams
from blink.engine.errors import RequestError


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint("llama-gqa")), max_num_seqs=4, max_num_batched_tokens=64, num_pages=64,
               max_model_len=128)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -1), ("max_tokens", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 2.0), ("top_k", -2),
    ("temperature", -0.1), ("min_p", 1.5), ("logprobs", 21), ("repetition_penalty", 0.0),
    ("presence_penalty", 3.0), ("seed", -1), ("stop_token_ids", [-5]), ("temperature", float("nan")),
    ("temperature", True), ("top_p", "0.5"),
    # Above 0, but 0 in the record's 32-bit float.
    ("top_p", 1e-46), ("repetition_penalty", 1e-46),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_sampling_field_is_rejected():
    with pytest.raises(ValueError, match="best_of_three"):
        SamplingParams(best_of_three=2)


def test_prompt_longer_than_the_context_is_rejected_and_nothing_is_lost(llm):
    good = [1, 2, 3]
    with pytest.raises(RequestError, match="context limit is 128"):
        llm.generate([good, list(range(1, 200))], SamplingParams(temperature=0, max_tokens=4))
    assert not llm._driver.has_work()
    assert len(llm.generate([good], SamplingParams(temperature=0, max_tokens=4))[0].token_ids) == 4


@pytest.mark.parametrize("prompt", [[], [1, 2, 99999], [1, -3]])
def test_bad_token_ids_are_rejected(llm, prompt):
    with pytest.raises(RequestError):
        llm.generate([prompt] if prompt else [[]], SamplingParams())


def test_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])


def test_stop_token_ids_and_max_tokens(llm):
    base = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=10))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_at = base.token_ids[4]
    stopped = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == base.token_ids[: base.token_ids.index(stop_at) + 1]


def test_outputs_come_in_vllm_s_shape(llm):
    """vLLM's quickstart reads `out.outputs[0].text`; logprobs are Logprob entries, ranked, with their text."""
    base = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=6))[0]
    stop_at = base.token_ids[3]
    out, = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                    stop_token_ids=[stop_at]))
    completion = out.outputs[0]
    assert out.finished and len(out.outputs) == 1 and completion.index == 0
    assert completion.token_ids == out.token_ids == base.token_ids[: base.token_ids.index(stop_at) + 1]
    assert completion.text == out.text == llm.tokenizer.decode(completion.token_ids)
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at
    assert base.outputs[0].finish_reason == "length" and base.outputs[0].stop_reason is None
    assert base.outputs[0].logprobs is None and base.outputs[0].cumulative_logprob is None
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        ranked = sorted((e for e in entry.values() if e.rank is not None), key=lambda e: e.rank)
        assert [e.rank for e in ranked] == [1, 2]
        assert ranked[0].logprob >= ranked[1].logprob
        assert entry[token].rank == 1  # greedy: the drawn token is the most likely
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
    drawn = sum(entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs, strict=True))
    assert completion.cumulative_logprob == pytest.approx(drawn)


def test_context_limit_ends_a_request_with_length(llm):
    out = llm.generate([list(range(1, 121))], SamplingParams(temperature=0, max_tokens=None))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_text_prompts_and_token_prompts_agree(llm):
    text = "The quick brown fox"
    ids = llm.tokenizer.encode(text)
    params = SamplingParams(temperature=0, max_tokens=5)
    by_text, by_ids = llm.generate([text, ids], params)
    assert by_text.prompt_token_ids == ids and by_text.token_ids == by_ids.token_ids
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids)
    assert llm.generate(ids, params)[0].token_ids == by_ids.token_ids  # one prompt given as a token list


def test_abort_ends_a_resident_request_and_spares_the_others(llm):
    driver = llm._driver
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    driver.add_request("a", [1, 2, 3], params, 30)
    driver.add_request("b", [4, 5, 6], params, 30)
    events = driver.step()
    assert {e.request_id for e in events} == {"a", "b"}
    assert driver.abort("a") == []  # resident: ended by the next step
    finishes, tokens_b = {}, 1
    while driver.has_work():
        for e in driver.step():
            if e.request_id == "b" and e.token is not None:
                tokens_b += 1
            if e.finish_reason:
                finishes[e.request_id] = e.finish_reason
    assert finishes == {"a": "abort", "b": "length"} and tokens_b == 30
    pool = llm.engine.pool
    assert int(pool.num_free) == pool.usable_pages
