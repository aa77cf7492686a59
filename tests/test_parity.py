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
