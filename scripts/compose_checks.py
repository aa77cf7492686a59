"""The compose smoke test's checks, run from the host against the stack's published ports (scripts/compose_smoke.sh):

  serve     /ready 200; a completion and a streamed chat completion with the OpenAI SDK; the ZeroMQ API with the
            API key compose gave the ingress (and refused without it)
  request   /ready 200 and one completion, served over the transport --transport names (/ready says which)
  failover  streams in flight while `--kill` (a shell command) kills the engine inside its container: every one ends
            with an `engine_failure` error event and [DONE] (none hangs), then the stack serves a completion again

Each check prints what it saw and its times; a failed check exits 1 with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai

from blink.ingress.zmq_client import BlinkError, Client


def wait_ready(url: str, timeout_s: float) -> float:
    """Seconds until /ready answers 200."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout_s:
        try:
            response = httpx.get(f"{url}/ready", timeout=5)
            if response.status_code == 200:
                return time.monotonic() - start
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.5)
    raise SystemExit(f"/ready did not answer 200 within {timeout_s:.0f} s (last: {last})")


def check_serve(args) -> None:
    print(f"/ready 200 after {wait_ready(args.url, args.ready_timeout):.1f} s")
    denied = httpx.post(f"{args.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
    assert denied.status_code == 401 and "error" in denied.json(), f"no key: {denied.status_code} {denied.text}"
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, timeout=120)
    model = _completion(client, "")
    text, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=16, temperature=0, stream=True):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(text) and finish in ("stop", "length"), (text, finish)
    print(f"streamed chat completion: {''.join(text)!r} ({finish})")
    zmq_client = Client(args.zmq, timeout_s=120, api_key=args.api_key)
    reply = zmq_client.generate("Once upon a time", max_tokens=8, temperature=0)
    zmq_client.close()
    assert reply.text and reply.token_ids, reply
    print(f"zeromq api ({args.zmq}): {reply.text!r}")
    stranger = Client(args.zmq, timeout_s=60)
    try:
        stranger.generate("Once upon a time", max_tokens=8)
        raise AssertionError("the ZeroMQ API served a request without the API key")
    except BlinkError as e:
        assert e.error.get("code") == "invalid_api_key", e.error
        print("zeromq api without the key: refused (invalid_api_key)")
    finally:
        stranger.close()


def _completion(client: openai.OpenAI, where: str) -> str:
    """A greedy completion through the OpenAI SDK, checked; the model's name."""
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens > 0, completion
    print(f"completion{where} ({model}): {completion.choices[0].text!r}")
    return model


def check_request(args) -> None:
    print(f"/ready 200 after {wait_ready(args.url, args.ready_timeout):.1f} s")
    ready = httpx.get(f"{args.url}/ready", timeout=5).json()
    assert ready.get("transport") == args.transport, f"/ready says {ready}"
    _completion(openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, timeout=120), f" over {args.transport}")


async def _stream(client: httpx.AsyncClient, model: str, first_token: asyncio.Event) -> tuple[list[dict], float]:
    """One long streamed completion: its events, and when (monotonic) it ended."""
    events = []
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append({"done": True})
                break
            events.append(json.loads(line[6:]))
            if "choices" in events[-1]:
                first_token.set()
    return events, time.monotonic()


async def _failover(args) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=httpx.Timeout(30, read=None)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        started = [asyncio.Event() for _ in range(args.streams)]
        tasks = [asyncio.create_task(_stream(client, model, event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
        killed = time.monotonic()
        subprocess.run(args.kill, shell=True, check=True)
        print(f"engine killed ({args.kill!r} took {time.monotonic() - killed:.1f} s); {args.streams} streams in flight")
        bound = args.deadline * 5
        done, hung = await asyncio.wait(tasks, timeout=bound)
        assert not hung, f"{len(hung)} of {args.streams} streams still open {bound:.0f} s after the engine was killed"
        ends = []
        for task in done:
            events, ended = task.result()
            errors = [e["error"] for e in events if "error" in e]
            assert errors and errors[-1].get("code") == "engine_failure" and events[-1] == {"done": True}, events[-3:]
            ends.append(ended - killed)
        print(f"every stream ended with an engine_failure error event and [DONE], {min(ends):.1f}-{max(ends):.1f} s "
              f"after the kill (watchdog deadline {args.deadline} s)")
        back = time.monotonic()
        while True:
            try:
                answer = await client.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4,
                                                                    "temperature": 0})
                if answer.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - back < args.ready_timeout, "the stack did not serve again after the kill"
            await asyncio.sleep(0.5)
        print(f"served again {time.monotonic() - killed:.1f} s after the kill (the engine restarted and loaded)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["serve", "request", "failover"])
    parser.add_argument("--url", required=True, help="the ingress's published HTTP address")
    parser.add_argument("--zmq", help="the ZeroMQ API's published endpoint (tcp://HOST:PORT)")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--kill", help="the shell command that kills the engine (failover)")
    parser.add_argument("--deadline", type=float, default=2.0, help="the stack's watchdog deadline (s)")
    parser.add_argument("--streams", type=int, default=4, help="streams in flight when the engine is killed")
    parser.add_argument("--transport", default="zmq", help="the transport the ingress must be on (request)")
    parser.add_argument("--ready-timeout", type=float, default=600)
    args = parser.parse_args()
    try:
        if args.check == "failover":
            asyncio.run(_failover(args))
        else:
            (check_serve if args.check == "serve" else check_request)(args)
    except AssertionError as e:
        sys.exit(f"compose smoke, {args.check}: FAILED: {e}")


if __name__ == "__main__":
    main()
