"""An OpenAI-compatible completions server whose timing and failures a test scripts, run in a thread.

It streams one token per chunk: the first after `ttft_s`, the others `gap_s` apart, and records when it sent
each, on the same perf_counter clock as the benchmark in the test's process, and each request's body. Prompts
pick failures: "http-400 ..." answers 400 in OpenAI's envelope, "error-event ..." sends a token then an error
event, "cut ..." ends the stream after two tokens with neither finish reason nor [DONE].
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from blink.bench.lib.server import free_port


@dataclass
class Served:
    prompt: str
    max_tokens: int
    received: float
    sent: list[float] = field(default_factory=list)  # when each token's chunk was sent
    body: dict = field(default_factory=dict)  # the request as sent, for tests of the fields a client adds


@dataclass
class Script:
    ttft_s: float = 0.2
    gap_s: float = 0.05
    served: list[Served] = field(default_factory=list)
    api_key: str | None = None  # asked of every request, as `blink serve --api-key` asks


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": {"message": "a valid API key is required", "type": "invalid_request_error",
                                   "param": None, "code": "invalid_api_key"}}, status_code=401)


def app_for(script: Script) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def key(request: Request, call_next):
        if script.api_key and request.headers.get("authorization") != f"Bearer {script.api_key}":
            return _unauthorized()
        return await call_next(request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "scripted", "object": "model", "max_model_len": 4096}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        received = time.perf_counter()
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        if isinstance(prompt, list):  # token ids: no script in them
            prompt = f"{len(prompt)} tokens"
        if prompt.startswith("http-400"):
            return JSONResponse({"error": {"message": "scripted refusal", "type": "invalid_request_error",
                                           "param": "prompt", "code": None}}, status_code=400)
        served = Served(prompt, n, received, body=body)
        script.served.append(served)

        def chunk(i: int) -> str:
            choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}
            return f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"

        async def stream():
            await asyncio.sleep(script.ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(script.gap_s)
                served.sent.append(time.perf_counter())
                yield chunk(i)
                if prompt.startswith("error-event"):
                    yield f"data: {json.dumps({'error': {'message': 'scripted failure', 'type': 'server_error'}})}\n\n"
                    return
                if prompt.startswith("cut") and i == 1:
                    return
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@contextmanager
def scripted_server(script: Script):
    server = uvicorn.Server(uvicorn.Config(app_for(script), host="127.0.0.1", port=free_port(), log_level="warning",
                                           loop="asyncio"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)
