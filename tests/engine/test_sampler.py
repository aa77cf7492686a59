"""The sampler against its definitions: filters, penalties, seeded noise, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core.sampler import SamplerFeatures, SamplingRows, apply_penalties, hash32, sample, uniform_noise

V = 50


def _rows(n: int, **overrides) -> SamplingRows:
    values = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                  frequency_penalty=0.0, seed=0, step_index=0)
    values |= overrides
    dtypes = {"top_k": torch.int64, "seed": torch.int64, "step_index": torch.int64}
    return SamplingRows(**{k: torch.full((n,), v, dtype=dtypes.get(k, torch.float32)) for k, v in values.items()})


def _draws(logits: torch.Tensor, n: int, **overrides) -> torch.Tensor:
    """n independent draws from one row of logits, through seeds 0..n-1."""
    rows = _rows(n, **overrides)
    rows.seed = torch.arange(n)
    features = SamplerFeatures(random=True, filtering=True, penalties=False)
    vocab_hash = hash32(torch.arange(logits.shape[-1]))
    return sample(logits.expand(n, -1).clone(), rows, features, vocab_hash).tokens


def test_noise_is_uniform_and_a_function_of_its_inputs():
    vocab_hash = hash32(torch.arange(1000))
    u = uniform_noise(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1]), vocab_hash)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.03
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u[0], uniform_noise(torch.tensor([1]), torch.tensor([0]), vocab_hash)[0])


def test_draws_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    tokens = _draws(logits, 20000)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.015)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    freq = (_draws(logits, 5000, temperature=0.25) == 0).float().mean().item()
    assert abs(freq - 1 / (1 + math.exp(-4))) < 0.02


def test_top_k_top_p_min_p_keep_only_the_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert set(_draws(logits, 2000, top_k=2).tolist()) == {0, 1}
    assert set(_draws(logits, 2000, top_p=0.75).tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert set(_draws(logits, 2000, top_p=0.5).tolist()) == {0}
    assert set(_draws(logits, 2000, min_p=0.25).tolist()) == {0, 1, 2}  # 0.15 >= 0.25 * 0.5
    # top-p applies to what top-k kept, renormalised: 0.5/0.8 covers 0.6.
    assert set(_draws(logits, 2000, top_k=2, top_p=0.6).tolist()) == {0}


def test_greedy_rows_ignore_noise_and_filters():
    logits = torch.randn(8, V)
    rows = _rows(8, temperature=0.0, top_k=3)
    rows.seed = torch.arange(8)
    out = sample(logits, rows, SamplerFeatures(random=True, filtering=True), hash32(torch.arange(V)))
    assert torch.equal(out.tokens, logits.argmax(-1))


def test_penalties_follow_vllm():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]])
    # The prompt 0 1 0, then 2 generated twice; -1: no token.
    seen = torch.tensor([[0, 1, 0, 2, 2, -1]])
    counts = torch.tensor([[0, 0, 0, 2, 2, 0]], dtype=torch.int32)
    rows = _rows(1, temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.2)
    features = SamplerFeatures(penalties=True)
    expected = torch.tensor([[1.0, -2.0, 0.5 - 0.2 - 0.2, 0.5]])
    torch.testing.assert_close(apply_penalties(logits.clone(), rows, seen, counts), expected)
    out = sample(logits, rows, features, hash32(torch.arange(4)), seen, counts)
    assert out.tokens.item() == expected.argmax().item() == 0
    rows.repetition_penalty[:] = 5.0
    assert sample(logits, rows, features, hash32(torch.arange(4)), seen, counts).tokens.item() == 3


def test_sparse_penalties_equal_the_dense_definition():
    """Over random rows, contexts with repeats, and every sign of penalty: the rewrite at the seen ids gives the
    very values of the definition applied to the whole vocabulary."""
    gen = torch.Generator().manual_seed(5)
    R, vocab, L = 6, 300, 40
    logits = torch.randn(R, vocab, generator=gen) * 3
    seen = torch.randint(0, 60, (R, L), generator=gen)
    seen[:, 30:] = -1
    seen[2] = -1  # a row with no tokens yet
    generated = torch.arange(L)[None, :].expand(R, -1) >= 10  # the first 10 are the prompt's
    dense_counts = torch.zeros(R, vocab, dtype=torch.int32).scatter_add_(
        1, seen.clamp(min=0), (generated & (seen >= 0)).int())
    prompt = torch.zeros(R, vocab, dtype=torch.bool).scatter_(1, seen[:, :10].clamp(min=0), seen[:, :10] >= 0)
    rows = _rows(R, repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=-0.4)
    rows.repetition_penalty[1] = 0.6
    counts = dense_counts.gather(1, seen.clamp(min=0))
    c = dense_counts.float()
    rep = rows.repetition_penalty[:, None]
    expected = torch.where(prompt | (dense_counts > 0), torch.where(logits > 0, logits / rep, logits * rep), logits)
    expected = expected - rows.frequency_penalty[:, None] * c - rows.presence_penalty[:, None] * (c > 0).float()
    assert torch.equal(apply_penalties(logits.clone(), rows, seen, counts), expected)


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, V)
    out = sample(logits, _rows(3, temperature=0.0), SamplerFeatures(logprobs=True), hash32(torch.arange(V)))
    expected = logits.log_softmax(-1)
    assert torch.allclose(out.logprob, expected.gather(1, out.tokens[:, None])[:, 0])
    assert torch.allclose(out.top_logprobs, expected.topk(20, dim=-1).values)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint("llama-gqa")), max_num_seqs=8, max_num_batched_tokens=64, num_pages=128)


def test_seeded_requests_repeat_and_different_seeds_differ(llm):
    prompt = [[3, 4, 5, 6]]
    a, b, c = (llm.generate(prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=16))[0].token_ids
               for s in (1, 1, 2))
    assert a == b and a != c


def test_engine_logprobs_cover_the_sampled_token_and_the_top_k(llm):
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) >= 3
        assert max(e.logprob for e in entry.values()) == entry[token].logprob  # greedy picks the most likely token
        assert all(e.logprob <= 0 for e in entry.values())
    assert llm.generate([[7, 8, 9]], SamplingParams(max_tokens=2))[0].logprobs is None


def test_penalties_change_greedy_output_in_the_engine(llm):
    prompt = [[5] * 12]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    penalised = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, frequency_penalty=2.0,
                                                    repetition_penalty=1.5))[0].token_ids
    assert plain != penalised
    assert len(set(penalised)) > len(set(plain)) or max(map(penalised.count, penalised)) <= 2


def test_min_tokens_holds_the_stop_ids_back(llm):
    """vLLM's min_tokens: a stop id (and eos) cannot be sampled until that many tokens are out."""
    prompt = [[7, 8, 9]]
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].token_ids[0]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first], min_tokens=3,
                                               logprobs=1))[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    assert first in held.logprobs[0]  # the raw distribution still has it at the top


def test_min_tokens_holds_stop_strings_back():
    from blink.engine.model.tiny_model import ensure_tiny_model
    from blink.ingress.detokenize import Detokenizer
    from blink.shared.tokenizer import Tokenizer

    tokenizer = Tokenizer(ensure_tiny_model()).raw
    ids = tokenizer.encode("ab ab ab ab ab ab").ids

    def first_stop(min_tokens: int) -> int:
        detok = Detokenizer(tokenizer, ["ab"], min_tokens=min_tokens)
        return [detok.push(t).stopped for t in ids].index(True)

    unheld = first_stop(0)
    assert first_stop(unheld + 2) >= unheld + 2  # "ab" came earlier, but not enough tokens were out


def test_the_largest_random_draw_stays_below_one():
    from blink.engine.core.sampler import bits_to_uniform

    u = bits_to_uniform(torch.tensor([0, 2**32 - 1]))
    assert u.dtype == torch.float32 and u[0] > 0 and u[1] < 1


def test_top_p_of_one_keeps_every_token_when_others_filter():
    logits = torch.randn(2, 150_000) * 6
    rows = _rows(2, top_p=1.0)
    rows.top_k[1] = 5  # a batch-mate that does filter
    from blink.engine.core.sampler import filtered

    kept = filtered(logits, rows)
    assert kept[0].all() and kept[1].sum() == 5


def test_a_top_p_of_zero_in_a_record_keeps_the_top_token():
    """The edges refuse it (tests/engine/test_requests.py), but a record the engine reads must never crash its step."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert set(_draws(logits, 200, top_p=0.0).tolist()) == {0}


def test_tiny_temperatures_are_greedy():
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    rows = _rows(1, temperature=1e-39)
    out = sample(logits, rows, SamplerFeatures(random=True), hash32(torch.arange(3)))
    assert out.tokens.item() == 1


def test_logit_bias_steers_greedy_and_seeded_sampling(checkpoint):
    """OpenAI's logit_bias: +100 makes a token certain, -100 rules the greedy choice out; neither changes the
    reported logprobs (raw, as vLLM reports them)."""
    from blink.engine import LLM, SamplingParams

    llm = LLM(str(checkpoint("llama-gqa")), max_num_seqs=4, max_num_batched_tokens=64, num_pages=64,
              max_model_len=128)
    prompt = [5, 6, 7, 8]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=0))[0]
    forced, banned, seeded = llm.generate([prompt] * 3, [
        SamplingParams(temperature=0, max_tokens=4, logit_bias={17: 100.0}, logprobs=0),
        SamplingParams(temperature=0, max_tokens=1, logit_bias={plain.token_ids[0]: -100.0}),
        SamplingParams(temperature=1.0, seed=3, max_tokens=4, logit_bias={42: 100.0}),
    ])
    assert forced.token_ids == [17] * 4 and seeded.token_ids == [42] * 4
    assert banned.token_ids[0] != plain.token_ids[0]
    forced_lp, plain_lp = forced.logprobs[0][17].logprob, plain.logprobs[0][plain.token_ids[0]].logprob
    assert forced_lp < 0 and plain_lp >= forced_lp
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
