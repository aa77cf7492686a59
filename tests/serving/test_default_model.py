"""The default model, SmolLM2-135M-Instruct from the package registry, against transformers' own loading of the same
GGUF file: offline and through `blink serve` with an OpenAI client, in float32 (where the two must agree)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from blink.bench.lib.server import running_server
from blink.engine import LLM, SamplingParams
from blink.shared.checkpoints import default_model

QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow."]
TEXT = "The best way to learn a new language is"
NEW_TOKENS = 24
EOS = 2  # <|im_end|>: the file's tokenizer.ggml.eos_token_id


@pytest.fixture(scope="module")
def reference():
    """transformers over the same GGUF file: its tokenizer, its chat template's prompts, its greedy continuations."""
    import transformers as tf

    path = default_model.gguf_path()
    tokenizer = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False) for q in QUESTIONS] + [TEXT]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    with torch.no_grad():
        greedy = [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
                  for ids in prompt_ids]
        logprobs = model(torch.tensor([prompt_ids[-1]])).logits[0].log_softmax(-1)
    return dict(tokenizer=tokenizer, prompts=prompts, prompt_ids=prompt_ids, greedy=greedy, logprobs=logprobs)


def _until_eos(ids: list[int]) -> list[int]:
    """transformers pads after EOS; Blink stops there (and reports the EOS token, as transformers does)."""
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


def test_greedy_tokens_match_transformers_offline(reference):
    llm = LLM(dtype="float32", num_pages=64)  # no model: the default
    assert llm.engine.model_name == default_model.NAME
    outputs = llm.generate(reference["prompts"], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    for out, ids, expected in zip(outputs, reference["prompt_ids"], reference["greedy"], strict=True):
        assert out.prompt_token_ids == ids
        assert out.token_ids == _until_eos(expected)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("BLINK_MODEL", raising=False)  # the tests serve the tiny model unless they say otherwise
        with running_server(tmp_path_factory.mktemp("serve"), "--dtype", "float32") as server:
            yield server


@pytest.mark.slow
def test_a_chat_through_the_openai_sdk_answers_right(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [default_model.NAME]
    reply = client.chat.completions.create(model=default_model.NAME, temperature=0, max_tokens=32,
                                           messages=[{"role": "user", "content": QUESTIONS[0]}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_served_greedy_tokens_match_transformers(server, reference):
    for ids, expected in zip(reference["prompt_ids"], reference["greedy"], strict=True):
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": default_model.NAME, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        expected = _until_eos(expected)
        assert r.json()["choices"][0]["text"] == reference["tokenizer"].decode(expected, skip_special_tokens=True)


@pytest.mark.slow
def test_lm_eval_loglikelihoods_match_transformers(server, reference):
    """lm-eval's local-completions loglikelihood request: token ids, echo, logprobs 1, max_tokens 0."""
    ids = reference["prompt_ids"][-1]
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": default_model.NAME, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0})
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert served[0] is None
    expected = reference["logprobs"][torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(served[1:]), expected, atol=1e-4)


def test_requests_that_set_no_sampling_get_the_model_cards():
    """GGUF files carry no sampling defaults: the default model's are written beside it, and the ingress's
    `--generation-config auto` (its default) applies them to requests that set none."""
    from blink.ingress.generation_config import SamplingDefaults
    from blink.shared.checkpoints.source import resolve

    model_dir = resolve(None, weights=False).path
    assert SamplingDefaults.read("auto", [model_dir]).knobs == default_model.SAMPLING
