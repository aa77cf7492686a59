"""vLLM's serving settings (issue 37), against an in-process ingress answered by a scripted engine: list flags and
several served model names, chat templates and their kwargs, continuous usage stats, CORS."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from blink.ingress.chat import load_chat_template
from blink.ingress.cors import CorsPolicy
from blink.services.cli import add_settings_flags, settings_from_args
from blink.services.watchdog import ProcessSupervisor
from blink.shared.settings import Settings
from tests.scripted_engine import ScriptedEngine, write_chat_model

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
                      "x-a", "x-b", "--default-chat-template-kwargs", '{"enable_thinking": false}')
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
            assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
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
