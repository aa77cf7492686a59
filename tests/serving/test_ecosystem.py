"""Requests shaped as the tools users already run send them, against `blink serve`: lm-evaluation-harness's
loglikelihood and generation requests (`local-completions`), vLLM's prompt_logprobs."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from blink.bench.lib.server import running_server
from blink.engine.model.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.slow  # a whole deployment

MODEL = "blink-tiny-llama-v1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ensure_tiny_model()
    # A window of 8 entries: a prompt's logprobs pass through it a few at a time.
    with running_server(tmp_path_factory.mktemp("serve"), "--max-num-seqs", "8", "--window", "8") as server:
        yield server


@pytest.fixture(scope="module")
def teacher():
    """transformers' own forward over the same checkpoint: each prompt token's logprob given those before it."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)

    return logprobs


def _ids(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]


def _completions(server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_eval_loglikelihood_requests_score_the_prompt_as_transformers_does(server, teacher):
    """lm-eval's local-completions sends token ids, echo, logprobs 1 and max_tokens 0 (older versions 1), and reads
    token_logprobs and top_logprobs from the context's end."""
    texts = ["The quick brown fox jumps", "Question: what is two plus two? Answer:"]
    contexts = [_ids(server, text) for text in texts]
    for max_tokens in (0, 1):
        out = _completions(server, {"prompt": contexts, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
                                    "temperature": 0})
        for text, ids, choice in zip(texts, contexts, sorted(out["choices"], key=lambda c: c["index"]), strict=True):
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(ids) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            expected = teacher(ids)
            for p in range(1, len(ids)):
                assert lp["token_logprobs"][p] == pytest.approx(float(expected[p - 1, ids[p]]), abs=1e-4)
                top = lp["top_logprobs"][p]
                assert max(top.values()) == pytest.approx(float(expected[p - 1].max()), abs=1e-4)
            offsets = lp["text_offset"]
            assert offsets[0] == 0 and offsets == sorted(offsets)
            assert choice["text"].startswith(text)  # the prompt's tokens decoded, special ones left out
        assert out["usage"]["completion_tokens"] == max_tokens * len(contexts)


def test_echo_of_a_text_prompt_and_a_generation_request(server):
    out = _completions(server, {"prompt": "Once upon a time", "echo": True, "max_tokens": 5, "temperature": 0})
    plain = _completions(server, {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0})
    assert out["choices"][0]["text"] == "Once upon a time" + plain["choices"][0]["text"]
    # lm-eval's generate_until: a stop list and a token budget.
    gen = _completions(server, {"prompt": ["Q: 2+2?\nA:", "Once"], "max_tokens": 8, "stop": ["\n\n"],
                                "temperature": 0, "seed": 1234})
    assert len(gen["choices"]) == 2 and all(c["finish_reason"] in ("stop", "length") for c in gen["choices"])
    nothing = _completions(server, {"prompt": "Once upon a time", "max_tokens": 0})
    assert nothing["choices"][0]["text"] == "" and nothing["choices"][0]["finish_reason"] == "length"


def test_vllm_prompt_logprobs_streamed_and_whole(server, teacher):
    ids = _ids(server, "Dear team, the results are in")
    out = _completions(server, {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0})
    scored = out["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    expected = teacher(ids)
    for p in range(1, len(ids)):
        entry = scored[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(float(expected[p - 1, ids[p]]), abs=1e-4)
        assert len(scored[p]) in (2, 3)  # the top 2, and the prompt's token when it is not among them
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 0,
                            "stream": True, "temperature": 0}) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    first = json.loads(chunks[0])["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) >= len(ids)
