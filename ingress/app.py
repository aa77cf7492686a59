"""The OpenAI-compatible HTTP API: completions, chat, models, tokenize, health, readiness, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blink.ingress.client import EngineHealth
from blink.ingress.errors import (
    APIError,
    api_error_handler,
    http_error_handler,
    validation_error_handler,
)
from blink.ingress.generate import Delta, choice_deltas, merged, slot_request
from blink.ingress.guard import RequestGuard
from blink.ingress.openapi import describe
from blink.ingress.protocol import (
    MAX_CHOICES,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    SamplingFields,
    TokenizeRequest,
)
from blink.ingress.reasoning import ReasoningParser
from blink.ingress.responses import Shape, collect, sse
from blink.ingress.responses_api import as_chat, response_events, response_object
from blink.ingress.state import IngressState
from blink.ingress.structured import grammar_of_body, reasoning_end_id
from blink.ingress.tools import ToolParser
from blink.ingress.validation import (
    chat_prompt,
    chat_tool_parser,
    check_model,
    check_token_ids,
    completion_prompts,
    context_room,
    encode,
)
from blink.shared.grammar import GrammarSpec
from blink.shared.service_class import CLASS_NAMES

log = structlog.get_logger()
DISCONNECT_POLL_S = 0.25


def create_app(state: IngressState) -> FastAPI:
    app = FastAPI(title="Blink", docs_url=None, redoc_url=None)
    app.state.blink = state
    _install_guards(app, state)
    # Registered in the order /openapi.json lists them.
    _add_probe_routes(app, state)
    _add_token_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _install_guards(app: FastAPI, state: IngressState) -> None:
    """What every route shares: OpenAI's error envelope, the guard (request id, API key, limits), CORS, the schema."""
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_middleware(RequestGuard, state=state)
    if state.cors is not None:
        state.cors.install(app)
    describe(app, secured=state.api_key is not None)


def _add_probe_routes(app: FastAPI, state: IngressState) -> None:
    """What orchestrators and Prometheus ask: liveness, readiness, metrics."""

    @app.get("/health", response_class=Response, responses={200: {"description": "up (an empty body)",
                                                                   "content": {}}})
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        health = state.client.health()
        reason = _not_ready_because(state, health)
        return JSONResponse(_readiness(state, health, reason), status_code=200 if reason is None else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus' text format", "content": {"text/plain": {}}}})
    async def metrics() -> Response:
        status = await asyncio.to_thread(state.engine_status)
        return Response(state.metrics.render(state.client, status, state.degraded), media_type="text/plain")


def _not_ready_because(state: IngressState, health: EngineHealth) -> str | None:
    """Why this ingress should get no traffic now; None when it is ready."""
    age_s = health.heartbeat_age_s
    return ("the ingress is draining" if state.draining else
            f"the engine is {health.state}" if health.state != "ready" else
            f"no engine heartbeat for {age_s:.1f} s" if age_s >= state.heartbeat_deadline_s else
            "the engine's admission limit is 0 (set_limits): it admits no request" if health.admission_limit == 0
            else None)


def _readiness(state: IngressState, health: EngineHealth, reason: str | None) -> dict:
    """/ready's body: the verdict, then what the ingress knows of itself and its engine."""
    age_s = health.heartbeat_age_s
    return {"ready": reason is None, **({"reason": reason} if reason else {}), "engine": health.state,
            "heartbeat_age_s": round(age_s, 3) if age_s < 1e9 else None,
            "admission_limit": health.admission_limit,
            "draining": state.draining, "drive": state.info.drive, "transport": state.transport,
            "degraded": state.degraded, "device": state.info.device, "epoch": health.epoch,
            "failovers": health.failovers, "scheduling_policy": state.info.scheduling_policy,
            "kv_host_pages": state.info.kv_host_pages, "prefix_caching": state.info.prefix_caching,
            "limitations": state.info.limitations}


def _add_token_routes(app: FastAPI, state: IngressState) -> None:
    """The served model's names, and its tokenizer both ways (vLLM's /tokenize and /detokenize)."""

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "blink",
                                            "max_model_len": state.info.max_model_len}
                                           for name in state.info.served_model_names]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        if body.model is not None:  # optional here, as in vLLM; named, it must be this server's
            check_model(state, body.model)

        def encoded() -> bytes:  # a large answer is serialised off the loop too
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            return json.dumps({"tokens": ids, "count": len(ids), "max_model_len": state.info.max_model_len}).encode()

        return Response(await encode(state, encoded, "prompt"), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            check_model(state, body.model)
        check_token_ids(state, body.tokens, "tokens")
        return {"prompt": await state.off_loop(state.tokenizer.decode, body.tokens, False)}


def _add_generation_routes(app: FastAPI, state: IngressState) -> None:
    """Completions and chat: each turns its body into prompts and choices, then shares _respond; responses is chat's."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        p = body.prompt  # counted before any is tokenized: a million empty prompts are refused at once
        if (1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p)) * body.n > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} choices (prompts times n) per request", param="n")
        grammar = await grammar_of_body(state, body)
        prompts = await completion_prompts(state, body)
        jobs = [(p, i * body.n + j) for i, p in enumerate(prompts) for j in range(body.n)]
        echo = await _echoed_texts(state, body, prompts) if body.echo else None
        return await _respond(state, request, body, jobs, body.max_tokens, body.logprobs, chat=False, echo=echo,
                              grammar=grammar)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        tools = chat_tool_parser(state, body)
        grammar = await grammar_of_body(state, body)
        prompt, text = await chat_prompt(state, body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        jobs = [(prompt, j) for j in range(body.n)]
        # A grammar waits for the end of the reasoning where it can tell it by its token; else it masks from the
        # first token, so the answer has no think block: all of it is content.
        end_id = reasoning_end_id(state, grammar, text)
        reasoning = state.reasoning_parser if grammar is None or end_id >= 0 else None
        return await _respond(state, request, body, jobs, body.max_completion_tokens or body.max_tokens, logprobs,
                              chat=True, tools=tools, reasoning=reasoning,
                              thinking=reasoning is not None and reasoning.starts_thinking(text), grammar=grammar,
                              reasoning_end_id=end_id)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, stateless: served as a chat completion (blink.ingress.responses_api)."""
        answer = await chat(as_chat(body), request)
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(response_events(body, answer.body_iterator), media_type="text/event-stream")
        return response_object(body, answer) if isinstance(answer, dict) else answer


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, awaitable):
    """Awaits, but gives up (cancelling the work, so the slot's request is cancelled) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise _ClientGone


async def _echoed_texts(state: IngressState, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """What echo repeats of each prompt: its text as given, or its tokens decoded."""
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if isinstance(p[0], str):
        return list(p)
    return await state.off_loop(lambda: [state.tokenizer.decode(x, body.skip_special_tokens) for x in prompts])


async def _respond(state: IngressState, request: Request, body: SamplingFields, jobs: list[tuple[list[int], int]],
                   max_tokens: int | None, logprobs: int | None, chat: bool, echo: list[str] | None = None,
                   tools: ToolParser | None = None, reasoning: ReasoningParser | None = None, thinking: bool = False,
                   grammar: GrammarSpec | None = None, reasoning_end_id: int = -1):
    """echo: each prompt's text, to go before its choices' (completions' echo); tools: the parser that finds tool
    calls in the choices' text, reasoning the one that splits their think block out, thinking whether the prompt
    opened one (chat's); grammar: the structured output every choice follows (checked), from the token
    reasoning_end_id on (-1: from the first)."""
    check_model(state, body.model)
    check_token_ids(state, [int(t) for t in body.logit_bias or ()], "logit_bias")
    capacity = state.client.num_slots + state.client.max_waiting
    if len(jobs) > capacity:
        raise APIError(400, f"{len(jobs)} choices can never fit: this server holds {capacity} at once", param="n")
    named_class = request.headers.get("x-blink-class")
    if named_class is not None and named_class.strip().lower() not in CLASS_NAMES:
        raise APIError(400, f"x-blink-class must name a service class (latency_sensitive or best_effort, or ls or "
                       f"be), got {named_class[:64]!r}", param="x-blink-class")
    # The prompt's logprobs are scored in the step: vLLM's prompt_logprobs, and what echo shows with logprobs.
    asked = [k for k in (body.prompt_logprobs, logprobs if echo is not None else None) if k is not None]
    prompt_logprobs = max(asked) if asked else None
    requests = []
    for prompt, index in jobs:
        room = context_room(state, prompt, max_tokens, "messages" if chat else "prompt")
        seed = body.seed + index if body.seed is not None else state.seeds.getrandbits(63)
        requests.append((slot_request(prompt, body, max_tokens, room, logprobs, seed, state.classes,
                                      state.sampling_defaults, named_class, prompt_logprobs, grammar,
                                      reasoning_end_id), index))
    choices = [choice_deltas(state.client, state.tokenizer, r, body, i, state.metrics, state.info.eos_token_ids,
                             counts_prompt=i % body.n == 0) for r, i in requests]
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    echoed = None if echo is None else {index: (echo[index // body.n], prompt) for prompt, index in jobs}
    shape = Shape(rid, int(time.time()), state.info.model, chat, state.tokenizer, logprobs is not None,
                   body.prompt_logprobs, echoed, tools, reasoning, thinking)
    prompt_tokens = sum(len(p) for p, i in jobs if i % body.n == 0)  # each prompt once, whatever n
    deltas = merged(choices)
    try:
        first = await _unless_disconnected(request, anext(deltas, None))  # surfaces 429 before any byte is sent
    except _ClientGone:
        await deltas.aclose()
        return Response(status_code=499)
    except APIError:  # a 429 (generate.choice_deltas), before any byte is sent
        await deltas.aclose()
        raise
    if body.stream:
        usage = body.stream_options.include_usage if body.stream_options else False
        continuous = usage and body.stream_options.continuous_usage_stats  # only with include_usage, as in vLLM
        return StreamingResponse(sse(shape, first, deltas, prompt_tokens, usage, continuous),
                                 media_type="text/event-stream")

    async def rest() -> list[Delta]:
        return [d async for d in deltas]

    try:
        return collect(shape, first, await _unless_disconnected(request, rest()), len(jobs), prompt_tokens)
    except _ClientGone:
        return Response(status_code=499)
    finally:
        await deltas.aclose()
