"""vLLM's serving settings (issue 37), against an in-process ingress answered by a scripted engine: list flags and
several served model names, chat templates and their kwargs, continuous usage stats, CORS, the generation config's
sampling defaults."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import openai
import pytest

from blink.bench.lib.server import running_server
from blink.ingress.chat import load_chat_template
from blink.ingress.cors import CorsPolicy
from blink.ingress.generation_config import SamplingDefaults
from blink.services.cli import add_settings_flags, settings_from_args
from blink.services.watchdog import ProcessSupervisor
from blink.shared.settings import Settings
from tests.support.scripted_engine import ScriptedEngine, write_chat_model

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def model_dir(tmp_path, tokenizer_dir):
    return write_chat_model(tmp_path / "model", tokenizer_dir)


@pytest.fixture
def engine(model_dir):
    engine = ScriptedEngine(model_dir, names=("first", "second"))
    engine.answer = "Hello."
    yield engine
    engine.close()


def _settings(*flags: str) -> Settings:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    return settings_from_args(parser.parse_args(list(flags)))


def test_list_flags_as_vllm_takes_them(monkeypatch):
    assert _settings("--served-model-name", "a", "b").served_model_name == ["a", "b"]
    given = _settings("--served-model-name", '["a", "b"]', "--allowed-origins", '["*"]', "--allowed-headers",
                      "x-a", "x-b", "--default-chat-template-kwargs", '{"enable_thinking": false}',
                      "--speculative-config", '{"model": "org/draft", "num_speculative_tokens": 4}')
    assert given.served_model_name == ["a", "b"] and given.allowed_origins == ["*"]
    assert given.allowed_headers == ["x-a", "x-b"] and given.default_chat_template_kwargs == {"enable_thinking": False}
    for bad in (["--served-model-name", "[x"], ["--served-model-name", "a", ""], ["--allowed-origins", '["*"'],
                ["--default-chat-template-kwargs", "[1]"], ["--default-chat-template-kwargs", '{"tools": []}']):
        with pytest.raises(ValueError):
            _settings(*bad)
    # `blink serve` hands its settings to the services as BLINK_* variables, which they read back the same.
    for name, value in ProcessSupervisor(given).env.items():
        if name.startswith("BLINK_"):
            monkeypatch.setenv(name, value)
    assert Settings().model_dump() == given.model_dump()
    monkeypatch.setenv("BLINK_SERVED_MODEL_NAME", "one")  # compose's plain variable
    assert Settings().served_model_name == ["one"]
    monkeypatch.setenv("BLINK_SERVED_MODEL_NAME", "")  # compose's unset one
    assert Settings().served_model_name is None


def test_several_served_model_names(engine):
    async def run():
        async with engine.ingress() as (http, client):
            listed = await client.models.list()
            assert [m.id for m in listed.data] == ["first", "second"]
            for name in ("first", "second"):
                reply = await client.chat.completions.create(model=name, messages=USER)
                assert reply.model == "first" and reply.choices[0].message.content == "Hello."
            r = await http.post("/v1/completions", json={"model": "third", "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert "'first', 'second'" in r.json()["error"]["message"]

    asyncio.run(run())


def test_chat_template_kwargs_over_the_server_s_defaults(engine):
    async def prompt_for(http, **body) -> str:
        r = await http.post("/v1/chat/completions", json={"model": "first", "messages": USER, **body})
        assert r.status_code == 200, r.text
        return engine.seen[-1].prompt

    async def run():
        async with engine.ingress() as (http, _):
            assert (await prompt_for(http)).endswith("<|im_start|>assistant\n")
            closed = await prompt_for(http, chat_template_kwargs={"enable_thinking": False})
            assert closed.endswith("assistant\n<think>\n\n</think>\n\n")
        async with engine.ingress(default_chat_template_kwargs={"enable_thinking": False}) as (http, _):
            assert (await prompt_for(http)).endswith("</think>\n\n")
            assert (await prompt_for(http, chat_template_kwargs={"enable_thinking": True})).endswith("assistant\n")

    asyncio.run(run())


def test_chat_template_flag_inline_or_a_file(engine, tmp_path):
    inline = load_chat_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}\\n{% endfor %}")
    assert inline.endswith("\n{% endfor %}")  # the shell's \\n, a newline, as vLLM reads it
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}!\\n")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0].content }}!\\n"  # a file as it is
    for bad in ("missing.jinja", "{% for m in messages %}"):
        with pytest.raises(ValueError):
            load_chat_template(bad)

    async def run():
        async with engine.ingress(chat_template=inline) as (http, _):
            r = await http.post("/v1/chat/completions", json={"model": "first", "messages": USER})
            assert r.status_code == 200 and engine.seen[-1].prompt == "[user] hi\n"

    asyncio.run(run())


@pytest.mark.parametrize("template, kwargs, param", [
    (None, [1], "chat_template_kwargs"),  # not an object
    (None, "enable_thinking", "chat_template_kwargs"),
    (None, {"messages": []}, "chat_template_kwargs"),  # the request's own
    (None, {"add_generation_prompt": False}, "chat_template_kwargs"),
    ("{{ 1 + shift }}", {"shift": "x"}, "chat_template_kwargs"),  # a kwarg the template cannot use
    ("{{ raise_exception('no ' + who) }}", {"who": "you"}, "messages"),  # the template's own refusal
])
def test_bad_chat_template_kwargs_are_400s(engine, template, kwargs, param):
    async def run():
        async with engine.ingress(chat_template=template) as (http, _):
            r = await http.post("/v1/chat/completions", json={"model": "first", "messages": USER,
                                                              "chat_template_kwargs": kwargs})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", error
            assert (await http.get("/health")).status_code == 200

    asyncio.run(run())


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER}),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 50}),
])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(engine, path, body):
    engine.answer = "One two three four five."

    async def chunks(**options) -> list[dict]:
        async with engine.ingress() as (http, _):
            r = await http.post(path, json={"model": "first", **body, "stream": True, "stream_options": options})
            assert r.status_code == 200, r.text
            return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    got = asyncio.run(chunks(include_usage=True, continuous_usage_stats=True))
    counts = [c["usage"]["completion_tokens"] for c in got]
    assert len(got) > 3 and counts == sorted(counts) and counts[0] >= 1
    assert got[-1]["choices"] == [] and got[-1]["usage"] == got[-2]["usage"]  # the last chunk: include_usage's
    assert counts[-1] == len(engine.tokenizer.encode(engine.answer, add_special_tokens=False))
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in got)
    # As vLLM: only with include_usage.
    assert not any("usage" in c for c in asyncio.run(chunks(continuous_usage_stats=True)))


def test_cors_only_when_origins_are_allowed(engine):
    assert CorsPolicy.of(Settings()) is None  # closed by default, unlike vLLM's
    policy = CorsPolicy.of(_settings("--allowed-origins", '["https://app.example"]', "--allowed-methods", "GET",
                                     "POST", "--allow-credentials"))
    assert policy == CorsPolicy(["https://app.example"], ["GET", "POST"], ["*"], True)
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}

    async def run():
        async with engine.ingress() as (http, _):
            r = await http.options("/v1/chat/completions", headers=preflight)
            assert "access-control-allow-origin" not in r.headers
            assert "access-control-allow-origin" not in (await http.get("/v1/models", headers=preflight)).headers
        async with engine.ingress(cors=policy, api_key="sekret") as (http, _):
            r = await http.options("/v1/chat/completions", headers=preflight)  # answered before the key is asked
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
            assert r.headers["access-control-allow-credentials"] == "true"
            origin = {"origin": "https://app.example"}
            r = await http.get("/v1/models", headers=origin)
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
            r = await http.get("/v1/models", headers={**origin, "authorization": "Bearer sekret"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
            r = await http.options("/v1/chat/completions", headers={**preflight, "origin": "https://evil.example"})
            assert r.status_code == 400 and "access-control-allow-origin" not in r.headers

    asyncio.run(run())


def test_the_generation_config_s_sampling_defaults(engine, tmp_path):
    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1, "max_new_tokens": 5,
              "do_sample": True, "eos_token_id": 7}
    (engine.model_dir / "generation_config.json").write_text(json.dumps(config))
    defaults = SamplingDefaults.read("auto", [tmp_path / "elsewhere", engine.model_dir])
    assert defaults == SamplingDefaults(knobs={"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                               "repetition_penalty": 1.0}, max_tokens=5)
    assert SamplingDefaults.read("vllm", [engine.model_dir]) == SamplingDefaults()
    assert SamplingDefaults.read(str(engine.model_dir), []) == defaults  # a directory holding one
    with pytest.raises(ValueError):
        SamplingDefaults.read(str(tmp_path / "missing"), [])
    # vLLM reads the differences from transformers' defaults (top_k 50); a value outside a knob's limits is skipped.
    assert SamplingDefaults.of({"top_k": 50, "temperature": 9.0, "top_p": "x", "min_p": 0.05}).knobs == {"min_p": 0.05}
    engine.answer = "One two three four five six seven eight."

    async def run():
        async with engine.ingress(sampling_defaults=defaults) as (http, client):
            reply = await client.chat.completions.create(model="first", messages=USER)
            assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
            seen = engine.seen[-1].fields
            assert seen["max_tokens"] == 5 and seen["top_k"] == 20 and seen["repetition_penalty"] == 1.0
            assert seen["temperature"] == pytest.approx(0.6) and seen["top_p"] == pytest.approx(0.95)
            # What a request gives wins, whatever the file says.
            await client.chat.completions.create(model="first", messages=USER, temperature=0.0, max_tokens=7,
                                                 extra_body={"top_k": -1})
            seen = engine.seen[-1].fields
            assert (seen["temperature"], seen["top_k"], seen["max_tokens"]) == (0.0, -1, 7)
            assert seen["top_p"] == pytest.approx(0.95)
            # Completions keep OpenAI's max_tokens default (16), as vLLM's do.
            r = await http.post("/v1/completions", json={"model": "first", "prompt": "Once"})
            assert r.status_code == 200 and engine.seen[-1].fields["max_tokens"] == 16
            assert engine.seen[-1].fields["temperature"] == pytest.approx(0.6)
        async with engine.ingress() as (_, client):  # vllm: the edge's own defaults
            await client.chat.completions.create(model="first", messages=USER)
            seen = engine.seen[-1].fields
            assert (seen["temperature"], seen["top_k"]) == (1.0, 0) and seen["max_tokens"] > 5

    asyncio.run(run())


def test_blink_serve_takes_the_flags(tmp_path):
    """The flags as vLLM's users write them, through `blink serve` to the ingress (the tiny random model thinks out
    loud: with deepseek_r1's parser its whole answer is reasoning)."""
    (tmp_path / "generation").mkdir()
    (tmp_path / "generation" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    flags = ["--served-model-name", "first", "second", "--reasoning-parser", "deepseek_r1",
             "--chat-template", "{{ greeting }}{% for m in messages %} {{ m.content }}{% endfor %}",
             "--default-chat-template-kwargs", '{"greeting": "Hello there"}', "--allowed-origins", '["*"]',
             "--generation-config", str(tmp_path / "generation"), "--max-num-seqs", "2"]
    with running_server(tmp_path, *flags) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["first", "second"]
        reply = client.chat.completions.create(model="second", messages=USER, extra_body={"ignore_eos": True})
        assert reply.model == "first" and reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 3  # the generation config's max_new_tokens
        message = reply.choices[0].message
        assert message.content is None and message.model_extra["reasoning_content"]
        prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there hi", "add_special_tokens": False})
        assert reply.usage.prompt_tokens == prompt.json()["count"]  # --chat-template with its default kwargs
        r = httpx.options(f"{server.url}/v1/chat/completions", headers={
            "origin": "https://app.example", "access-control-request-method": "POST"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
