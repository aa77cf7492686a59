"""Greedy tokens and last-position logits against transformers on the same random checkpoints."""

from __future__ import annotations

import pytest
import torch

from blink.engine import LLM, SamplingParams
from tests.conftest import CHECKPOINT_KINDS

PROMPT_LENGTHS = [3, 9, 17, 31, 40, 58, 5, 70]
NEW_TOKENS = 24


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _reference(model_dir, prompts):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, logits = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)
            tokens.append(out[0, len(ids):].tolist())
            logits.append(model(x).logits[0, -1])
    return tokens, logits


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
def test_greedy_tokens_and_logits_match_transformers(kind, checkpoint):
    model_dir = checkpoint(kind)
    prompts = _prompts(1174)
    expected_tokens, expected_logits = _reference(model_dir, prompts)

    # A 32-token budget forces the longer prompts to prefill in chunks while others decode.
    # float32 as the reference runs (auto would pick bfloat16 on a CPU with native bfloat16).
    llm = LLM(str(model_dir), max_num_seqs=8, max_num_batched_tokens=32, num_pages=200, dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    for out, expected in zip(outputs, expected_tokens, strict=True):
        assert out.token_ids == expected
        assert out.finish_reason == "length"

    for ids, expected in zip(prompts, expected_logits, strict=True):
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
        out = llm._driver.last_output
        row = (out.row_slot >= 0).nonzero()[0, 0]
        torch.testing.assert_close(out.row_logits[row], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS[:1])
def test_prompt_logprobs_match_a_teacher_forced_transformers_pass(kind, checkpoint):
    """vLLM's prompt_logprobs, scored inside the step: a 32-token budget chunks the longer prompts, and several
    requests score at once beside generating ones."""
    import transformers as tf

    model_dir = checkpoint(kind)
    prompts = _prompts(1174)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), max_num_seqs=8, max_num_batched_tokens=32, num_pages=200, dtype="float32")
    asks = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3 if i % 2 else 0)
            for i in range(len(prompts))]
    outputs = llm.generate(prompts, asks)
    for ids, params, out in zip(prompts, asks, outputs, strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for p in range(1, len(ids)):
            got = out.prompt_logprobs[p]
            assert ids[p] in got
            torch.testing.assert_close(torch.tensor(got[ids[p]].logprob), expected[p - 1, ids[p]], rtol=1e-4, atol=1e-4)
            top = expected[p - 1].topk(params.prompt_logprobs)
            assert set(got) == set(top.indices.tolist()) | {ids[p]}
        assert len(out.token_ids) == 2
