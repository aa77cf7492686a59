"""The OpenAI API end to end: the official client against `blink serve`, outputs equal the offline engine's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import httpx
import openai
import pytest

from blink.bench.lib.server import running_server
from blink.engine import LLM, SamplingParams
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.ingress.chat import render_chat
from blink.ingress.client import Overloaded
from blink.ingress.protocol import ChatMessage
from blink.ingress.slots import SlotClient
from blink.shared import control
from blink.shared.service_class import ServiceClass
from blink.shared.slot_table import EngineState, Finish, Geometry, Request, SlotTable

pytestmark = pytest.mark.slow  # whole deployments (blink serve): CI runs them; `-m "not slow"` skips them

MODEL = "blink-tiny-llama-v1"
PROMPTS = ["Once upon a time", "The quick brown fox", "Question: What is two plus two?", "Dear team,"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ensure_tiny_model()
    with running_server(tmp_path_factory.mktemp("serve"), "--max-num-seqs", "16", "--window", "8") as server:
        yield server


@pytest.fixture(scope="module")
def offline():
    return LLM(str(ensure_tiny_model()), num_pages=512)


def _expected(offline, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.text for o in offline.generate(prompts, params)]


def test_completions_sync_client_matches_offline(server, offline):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    got = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
           for p in PROMPTS]
    assert got == _expected(offline, PROMPTS, 12)
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == got
    assert batch.usage.completion_tokens == 12 * len(PROMPTS)


def test_chat_async_streaming_matches_offline(server, offline):
    messages = [{"role": "user", "content": "Say something nice."}]
    text = render_chat(offline.tokenizer, [ChatMessage(**m) for m in messages], True)
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    expected = offline.generate([ids], SamplingParams(temperature=0, max_tokens=10))[0]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
        parts, finishes, usage = [], [], None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finishes += [choice.finish_reason] if choice.finish_reason else []
        plain = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
        return "".join(parts), finishes, usage, plain

    streamed, finishes, usage, plain = asyncio.run(run())
    assert streamed == expected.text == plain.choices[0].message.content
    assert finishes == [expected.finish_reason]
    assert usage.completion_tokens == len(expected.token_ids) and usage.prompt_tokens == len(ids)


def test_64_concurrent_streams_each_end_once_with_the_offline_output(server, offline):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]
    expected = _expected(offline, prompts, 16)

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        text, finishes = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text
            finishes += chunk.choices[0].finish_reason is not None
        return text, finishes

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run())
    assert [finishes for _, finishes in results] == [1] * 64
    assert [text for text, _ in results] == expected


def test_n_seed_stop_and_logprobs(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3,
                                    seed=5, logprobs=2)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3,
                                      seed=5, logprobs=2)
    assert [c.text for c in out.choices] == [c.text for c in again.choices]
    assert len({c.text for c in out.choices}) > 1
    assert all(len(c.logprobs.token_logprobs) == 8 for c in out.choices)
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0).choices[0].text
    stop = full[3:6]
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]


def test_a_client_that_disconnects_frees_its_slot(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", json={
            "model": MODEL, "prompt": "Once", "max_tokens": 1500, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{server.url}/metrics").text
        if 'blink:num_requests_running{model_name="blink-tiny-llama-v1"} 0.0' in metrics:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the slot was not freed within a second")
    status = server.request(server.control_endpoint, control.GetStatus())
    assert status.running == 0  # the engine is not computing for it either
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_admission_limit_over_the_control_plane(server):
    """With a limit of 0 nothing is admitted; lifting it lets the waiting request through."""
    assert isinstance(server.request(server.control_endpoint, control.SetLimits(max_running=0)), control.Ack)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
        pending = asyncio.ensure_future(aclient.completions.create(model=MODEL, prompt="x", max_tokens=3,
                                                                   extra_body={"ignore_eos": True}))
        await asyncio.sleep(0.5)
        held = not pending.done() and server.request(server.control_endpoint, control.GetStatus()).running == 0
        server.request(server.control_endpoint, control.SetLimits(max_running=None))
        return held, await pending

    try:
        held, result = asyncio.run(run())
    finally:
        server.request(server.control_endpoint, control.SetLimits(max_running=None))
    assert held and result.usage.completion_tokens == 3


@pytest.mark.parametrize("body, status, param, code", [
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "top_p": 1e-46}, 400, "top_p", "invalid_value"),  # 0 as a 32-bit float
    ({"model": MODEL, "prompt": "x", "temperature": True}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "ttft_slo_ms": True}, 400, "ttft_slo_ms", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": True}}, 400, "logit_bias.5", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"05": 1, "5": 2}}, 400, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"0": 1, "00": 2}}, 400, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": [""] * 100_000}, 400, "n", None),  # refused before tokenizing any
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ({"model": MODEL}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "prompt", None),
    ({"model": MODEL, "prompt": []}, 400, "prompt", None),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "x" * 9000}, 400, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, None, "invalid_value"),
])
def test_bad_completions_get_400_with_the_envelope(server, body, status, param, code):
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code
    assert len(r.text) < 1000  # never echoes a long input back


def test_malformed_json_and_bad_chat(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps({"model": MODEL, "prompt": "x"}),
                   headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "content-type: application/json" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard",
                                                                                         "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [image]})
    assert r.status_code == 400 and "'image_url' are not supported" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "top_logprobs": 2,
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "top_logprobs needs logprobs" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL, "prompt": "\ud800", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "\udfff"]}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/tokenize", {"prompt": "\udc00x"}, "prompt"),
])
def test_text_that_is_not_unicode_is_a_400(server, path, body, param):
    """JSON's escapes can spell a lone surrogate, which no tokenizer takes: a 400 on the field, and the server
    serves on."""
    content = json.dumps(body).encode()  # ASCII: the surrogate as JSON's \\ud800 escape
    r = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "Unicode" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_the_openapi_schema_describes_what_is_served(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert '"422"' not in json.dumps(schema)  # validation errors are 400s here
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    for status in ("400", "413", "429", "503"):
        assert completions[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorEnvelope")
    assert set(schema["components"]["schemas"]["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert not schema["paths"]["/health"]["get"]["responses"]["200"]["content"]
    assert httpx.get(f"{server.url}/health").content == b""
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["type"]


def test_tokenize_detokenize_and_request_ids(server, offline):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert r.json()["tokens"] == offline.tokenizer.encode("Hello world")
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": offline.tokenizer.encode("Hello world",
                                                                                     add_special_tokens=False)})
    assert r.json()["prompt"] == "Hello world"
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(f"{server.url}{path}", json={"model": "gpt-4", **body})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_overload_answers_429_and_api_key_401(tmp_path):
    ensure_tiny_model()
    with running_server(tmp_path, "--max-num-seqs", "1", "--max-waiting", "0", "--api-key", "sekret") as server:
        url = server.url
        assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
        headers = {"authorization": "Bearer sekret"}
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as first:
            lines = first.iter_lines()  # held, so the stream stays open
            next(lines)
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                           headers=headers)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        deadline = time.monotonic() + 2  # the abandoned stream's slot frees within a step or two
        while True:
            ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                            headers=headers)
            if ok.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert ok.status_code == 200


def test_a_choice_displaced_after_the_first_token_is_a_429_or_an_error_event(tmp_path):
    """n=2 best-effort on one slot: the first choice runs, the second waits and gives way to a latency-sensitive
    arrival. Non-streamed, the whole request is a 429 (was a 500); streamed, the headers are out, so an error event
    and [DONE]. The latency-sensitive request is served either way."""
    ensure_tiny_model()
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "n": 2,
            "service_class": "best_effort"}
    urgent = {"model": MODEL, "prompt": "x", "max_tokens": 2, "service_class": "latency_sensitive"}
    with running_server(tmp_path, "--max-num-seqs", "1", "--max-waiting", "1") as server:
        url = f"{server.url}/v1/completions"

        def streamed() -> list[str]:
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                return [line for line in r.iter_lines() if line]

        for stream in (False, True):
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(streamed) if stream else pool.submit(httpx.post, url, json=body, timeout=60)
                deadline = time.monotonic() + 30  # the first choice runs, the second waits
                while (_metric(server, "blink:num_requests_running"), _metric(server, "blink:num_requests_waiting")) \
                        != (1, 1):
                    assert time.monotonic() < deadline and not answer.done()
                    time.sleep(0.05)
                assert httpx.post(url, json=urgent, timeout=60).status_code == 200
                if stream:
                    lines = answer.result()
                    error = json.loads(lines[-2].removeprefix("data: "))["error"]
                    assert error["code"] == "overloaded" and lines[-1] == "data: [DONE]", lines[-3:]
                else:
                    r = answer.result()
                    assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded", r.text


def test_the_ingress_never_imports_torch():
    code = ("import sys, blink.ingress.app, blink.services.ingress_service; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_zmq_client_sync_and_async_match_http(server, offline):
    from blink.ingress.zmq_client import AsyncClient, BlinkError, Client

    expected = _expected(offline, PROMPTS[:2], 10)
    client = Client(server.zmq_endpoint)
    try:
        got = [client.generate(p, max_tokens=10, temperature=0) for p in PROMPTS[:2]]
        assert [g.text for g in got] == expected and all(g.finish_reason == "length" for g in got)
        chunks = list(client.stream(PROMPTS[0], max_tokens=10, temperature=0))
        assert [c.finish_reason for c in chunks].count("length") == 1 and chunks[-1].finish_reason == "length"
        with pytest.raises(BlinkError, match="max_tokens"):
            client.generate("x", max_tokens=-2)
        # A structured output is followed as over HTTP (it was once dropped: the answer ran unconstrained), and
        # refused with its reason where HTTP refuses it.
        for seed in range(3):
            chosen = client.generate(PROMPTS[0], max_tokens=10, temperature=1.0, seed=seed,
                                     structured_outputs={"choice": ["yes", "no"]})
            assert chosen.text in ("yes", "no") and chosen.finish_reason == "stop"
        with pytest.raises(BlinkError, match="ignore_eos cannot be combined"):
            client.generate("x", max_tokens=4, ignore_eos=True, structured_outputs={"regex": "[a-z]+"})
    finally:
        client.close()

    async def run():
        aclient = AsyncClient(server.zmq_endpoint)
        try:
            return "".join([c.text async for c in aclient.stream(PROMPTS[1], max_tokens=10, temperature=0)])
        finally:
            aclient.close()

    assert asyncio.run(run()) == expected[1]


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tmp_path):
    """Asked at once after the signal: once the in-flight request ends, the drained ingress exits and the watchdog
    starts another, which serves again (a loaded CI runner once took that long to ask, and got a 200)."""
    ensure_tiny_model()
    with running_server(tmp_path, "--max-num-seqs", "2", "--shutdown-timeout", "20") as server:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            next(lines)
            ingress = [p for p in _children(server.process.pid) if "ingress" in p[1]]
            assert ingress, "no ingress process"
            os.kill(ingress[0][0], signal.SIGTERM)
            deadline = time.monotonic() + 5
            while (answer := httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                                                "max_tokens": 1})).status_code == 200:
                assert time.monotonic() < deadline, "still served 5 s after SIGTERM"  # asked before the signal landed
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "draining"
            assert httpx.get(f"{server.url}/ready").status_code == 503
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in rest[-2]


def _children(pid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [(int(line.split(None, 1)[0]), line.split(None, 1)[1]) for line in out.strip().splitlines()]


def test_a_non_streaming_client_that_leaves_cancels_its_request(server):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 2.0
    while server.request(server.control_endpoint, control.GetStatus()).running:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.05)


def test_stop_token_text_is_dropped_and_prompt_tokens_count_once(server, offline):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    ids = offline.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    k = next(i for i, t in enumerate(ids) if i > 0 and t not in ids[:i])  # a token's first appearance
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": [ids[k]]})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == offline.tokenizer.decode(ids[:k])
    three = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=3, temperature=0)
    one = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens


def test_prefix_caching_through_the_api(server, offline):
    """A long prompt sent again is answered from its cached pages (OpenAI's usage says how many tokens), with the
    offline engine's tokens; a request with another cache_salt shares nothing; /metrics and /ready say so."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    prompt = list(range(100, 400))  # 300 tokens: 18 full pages of 16, the last token always computed

    def send(**extra):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, **extra})

    cold, warm, salted = send(), send(), send(cache_salt="another tenant")
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].text
    assert cold.choices[0].text == warm.choices[0].text == salted.choices[0].text == want
    assert warm.usage.prompt_tokens_details.cached_tokens == 288
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True})
    assert next(c.usage for c in stream if c.usage).prompt_tokens_details.cached_tokens == 288
    metrics = httpx.get(f"{server.url}/metrics").text
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("blink:prefix_cache_hits_total"))
    assert hits >= 2 * 288 and 'prefix_caching="on"' in metrics
    assert httpx.get(f"{server.url}/ready").json()["prefix_caching"] is True
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_zmq_api_answers_odd_frames(server):
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.zmq_endpoint)
    try:
        odd = [{"prompt": "x", "top_k": 2**40}, {"prompt": "x", "echo": True}, {"prompt": "x", "prompt_logprobs": 1},
               {"prompt": "x", "logit_bias": {"999999": 1}}]  # the last two the ZeroMQ API had ignored
        for frame in (b"\xff\xfe not utf-8", b"[1, 2]", *(json.dumps(body).encode() for body in odd)):
            sock.send_multipart([b"", frame])
            assert sock.poll(3000), f"no reply to {frame!r}"
            assert json.loads(sock.recv_multipart()[-1])["error"]["type"] == "invalid_request_error", frame
        sock.send_multipart([b"", json.dumps({"prompt": "x", "max_tokens": 0}).encode()])  # 0 is 0, not the context
        assert sock.poll(10000)
        reply = json.loads(sock.recv_multipart()[-1])
        assert reply["token_ids"] == [] and reply["finish_reason"] == "length", reply
    finally:
        sock.close()


@contextlib.asynccontextmanager
async def _table_client(num_slots: int, **options):
    """A fresh slot table with a started SlotClient on it; both gone afterwards."""
    table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(num_slots, 8, 4))
    client = SlotClient(table, **options)
    client.start()
    try:
        yield table, client
    finally:
        await client.stop()
        table.close()
        table.unlink()


def test_a_table_replaced_by_a_restarted_engine_ends_what_was_in_flight_and_restarts_the_ingress(monkeypatch):
    """An engine that restarted with another geometry made a new table at the same path: the request published
    into the old one fails after what it produced, the waiting one and later ones get 503s, the ingress drains (a
    SIGTERM to itself) to be started again, and cleaning up the old table leaves the new one alone."""
    from blink.ingress.errors import APIError
    from blink.services import ingress_service

    signals = []
    monkeypatch.setattr(ingress_service.signal, "raise_signal", signals.append)
    monkeypatch.setattr(ingress_service, "TABLE_CHECK_S", 0.01)

    async def run():
        async with _table_client(1, max_waiting=4) as (table, client):
            follower = asyncio.create_task(ingress_service.restart_when_replaced(SimpleNamespace(client=client)))
            running = await client.submit(Request([1], 4))
            outputs = client.outputs(running)
            table.admit(0)
            table.emit(0, 5)
            waiting = asyncio.ensure_future(client.submit(Request([2], 4)))
            await asyncio.sleep(0.05)
            assert not follower.done() and not client.replaced()
            table.unlink()
            new = SlotTable.create(table.path.name.removeprefix("blink-"), Geometry(1, 16, 4))
            try:
                await asyncio.wait_for(follower, 5)
                assert signals == [signal.SIGTERM]
                got = [out async for out in outputs]
                assert got[-1].finish == Finish.FAILED and [t for out in got for t in out.tokens] == [5]
                for submitted in (waiting, client.submit(Request([3], 4))):
                    with pytest.raises(APIError) as refused:
                        await submitted
                    assert refused.value.status == 503
                table.remove_if_abandoned()
                table.unlink()
                assert SlotTable.attach(new.path.name.removeprefix("blink-")).geometry == new.geometry
            finally:
                new.close()
                new.path.unlink()

    asyncio.run(run())


def test_a_stop_token_whose_finish_comes_in_a_later_read_adds_no_text():
    """The engine publishes a token, then its finish: a poll between the two sees the stop token without the
    finish. Its id is reported, its text is not (include_stop_str_in_output is off)."""
    from blink.ingress.generate import choice_deltas
    from blink.ingress.metrics import Metrics
    from blink.ingress.protocol import CompletionRequest
    from blink.shared.tokenizer import Tokenizer

    tokenizer = Tokenizer(ensure_tiny_model())
    word, stop = tokenizer.encode(" Hello world", add_special_tokens=False)[-2:]
    body = CompletionRequest(model=MODEL, prompt="x", stop_token_ids=[stop])

    async def run():
        async with _table_client(1, max_waiting=4) as (table, client):
            request = Request([1], 8, stop_token_ids=(stop,))
            deltas = choice_deltas(client, tokenizer, request, body, 0, Metrics(MODEL, "host", "shm"), [])
            got = asyncio.ensure_future(_all(deltas))
            await asyncio.sleep(0.05)
            table.admit(0)
            table.emit(0, word)
            table.emit(0, stop)
            await asyncio.sleep(0.05)  # the poller reads both tokens, no finish yet
            table.finish(0, Finish.STOP)
            return await asyncio.wait_for(got, 5)

    deltas = asyncio.run(run())
    assert [t for d in deltas for t in d.token_ids] == [word, stop]
    assert "".join(d.text for d in deltas) == tokenizer.decode([word]) and deltas[-1].finish == Finish.STOP


async def _all(iterator) -> list:
    return [item async for item in iterator]


def test_ready_allows_the_engine_the_watchdog_s_deadline_between_heartbeats():
    """A step may take up to the watchdog's deadline (a long prefill on a CPU): /ready holds until then."""
    from blink.ingress.app import create_app
    from blink.ingress.metrics import Metrics
    from blink.ingress.state import IngressState
    from blink.shared.tokenizer import Tokenizer

    model_dir = ensure_tiny_model()
    info = control.EngineInfo(slot_table="t", num_slots=4, epoch=1, served_model_names=[MODEL],
                              model_dir=str(model_dir), max_model_len=512, vocab_size=1, eos_token_ids=[],
                              device="cpu", drive="host", pid=0)

    async def ready(deadline_s: float) -> int:
        async with _table_client(1, max_waiting=1) as (table, client):
            table.header["engine_state"] = EngineState.READY
            table.header["last_step_ns"] = time.monotonic_ns() - 3 * 10**9  # a step 3 s long so far
            state = IngressState(info=info, tokenizer=Tokenizer(model_dir), client=client,
                                 metrics=Metrics(MODEL, "host", "shm"), heartbeat_deadline_s=deadline_s)
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as http:
                return (await http.get("/ready")).status_code

    assert asyncio.run(ready(2.0)) == 503 and asyncio.run(ready(10.0)) == 200


def test_a_late_cancel_never_touches_the_slot_s_next_owner():
    async def run():
        async with _table_client(1, max_waiting=4) as (table, client):
            first = await client.submit(Request([1], 4))
            outputs = client.outputs(first)
            table.admit(0)
            table.emit(0, 5)
            table.finish(0, Finish.STOP)
            second = asyncio.ensure_future(client.submit(Request([2], 4)))  # waits for the slot
            await asyncio.sleep(0.05)  # the poller reads the finish, frees the slot, hands it on
            assert second.done() and table.slots[0]["state"] == 1
            await outputs.aclose()  # the first consumer leaves without having read its finish
            return int(table.slots[0]["cancel"])

    assert asyncio.run(run()) == 0


def test_latency_sensitive_requests_take_reserved_slots_and_wait_first():
    def request(service_class: ServiceClass) -> Request:
        return Request([1], 4, service_class=int(service_class), ttft_slo_ms=1000.0)

    async def run():
        async with _table_client(3, max_waiting=4, reserved_slots=1) as (table, client):
            best_effort = [await client.submit(request(ServiceClass.BEST_EFFORT)) for _ in range(2)]
            third = asyncio.ensure_future(client.submit(request(ServiceClass.BEST_EFFORT)))
            await asyncio.sleep(0.05)
            assert not third.done()  # the last slot is the latency-sensitive reserve
            urgent = await asyncio.wait_for(client.submit(request(ServiceClass.LATENCY_SENSITIVE)), 1)
            assert table.slots[urgent.slot]["service_class"] == ServiceClass.LATENCY_SENSITIVE
            assert table.slots[urgent.slot]["ttft_slo_ms"] <= 1000.0  # what remains after its wait
            waiting_urgent = asyncio.ensure_future(client.submit(request(ServiceClass.LATENCY_SENSITIVE)))
            await asyncio.sleep(0.05)
            table.admit(best_effort[0].slot)
            table.finish(best_effort[0].slot, Finish.STOP)  # one slot frees: the latency-sensitive waiter gets it
            await asyncio.wait_for(waiting_urgent, 1)
            assert not third.done()
            third.cancel()

    asyncio.run(run())


def _metric(server, name: str, **labels: str) -> float:
    prefix = name + "{" + ",".join(f'{k}="{v}"' for k, v in {"model_name": MODEL, **labels}.items()) + "}"
    text = httpx.get(f"{server.url}/metrics").text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def test_class_defaults_change_through_the_control_plane_without_a_restart(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    judged = dict(service_class="best_effort", slo="ttft")
    before = _metric(server, "blink:slo_requests_total", **judged)
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers={"x-blink-class": "be"}).status_code == 200
    assert _metric(server, "blink:slo_requests_total", **judged) == before  # best-effort has no SLO by default

    def classes(*flags: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "blink.services.cli", "classes", "--deployment", server.deployment,
                              "--runtime-dir", str(server.runtime_dir), *flags], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)["defaults"]

    assert classes("--be-ttft-slo-ms", "60000")["best_effort"]["ttft_slo_ms"] == 60000
    try:
        ok = httpx.post(f"{server.url}/v1/completions", json=body, headers={"x-blink-class": "best-effort"})
        assert ok.status_code == 200
        assert _metric(server, "blink:slo_requests_total", **judged) == before + 1
        assert _metric(server, "blink:slo_attained_total", **judged) >= 1
        assert _metric(server, "blink:slo_attainment", **judged) > 0
        # The body's class wins over the header's; the class's default stays for what the request did not set.
        body_class = {**body, "service_class": "latency_sensitive"}
        ls_before = _metric(server, "blink:e2e_request_latency_seconds_count", service_class="latency_sensitive")
        assert httpx.post(f"{server.url}/v1/completions", json=body_class,
                          headers={"x-blink-class": "be"}).status_code == 200
        assert _metric(server, "blink:e2e_request_latency_seconds_count",
                       service_class="latency_sensitive") == ls_before + 1
    finally:
        assert classes("--be-ttft-slo-ms", "0")["best_effort"]["ttft_slo_ms"] is None


@pytest.mark.parametrize(("extra", "headers", "param"), [
    ({"service_class": "urgent"}, {}, "service_class"),
    ({"ttft_slo_ms": -5}, {}, "ttft_slo_ms"),
    ({}, {"x-blink-class": "gold"}, "x-blink-class"),
])
def test_bad_classes_and_slos_are_400s(server, extra, headers, param):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_a_latency_sensitive_arrival_displaces_the_newest_best_effort_waiter_when_the_line_is_full():
    async def run():
        async with _table_client(1, max_waiting=2) as (_, client):
            await client.submit(Request([1], 4, service_class=int(ServiceClass.BEST_EFFORT)))  # takes the slot
            older, newer = (asyncio.ensure_future(client.submit(Request([1], 4, service_class=1))) for _ in range(2))
            await asyncio.sleep(0.05)
            urgent = asyncio.ensure_future(client.submit(Request([1], 4, service_class=0)))
            await asyncio.sleep(0.05)
            assert isinstance(newer.exception(), Overloaded) and not older.done() and not urgent.done()
            with pytest.raises(Overloaded):  # a full line still refuses best-effort arrivals
                await client.submit(Request([1], 4, service_class=1))
            for waiter in (older, urgent):
                waiter.cancel()

    asyncio.run(run())
