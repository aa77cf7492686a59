"""The ZeroMQ client API: a ROUTER endpoint on the ingress that streams a request's tokens back.

Wire format, one JSON frame each way after the DEALER's empty delimiter: the client sends a completion
request (the OpenAI completions body plus an `id` the client picks, and `api_key` when the server has one;
`model` may be left out; no echo, prompt_logprobs, logprobs or include_usage, which the chunks cannot carry;
at most --max-request-bytes, or libzmq drops the connection); the ingress
answers with chunks `{"id", "text", "token_ids", "finish_reason"}` until one carries a finish reason, or one
`{"id", "error": {...}}` with OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets

import structlog
import zmq
import zmq.asyncio
from pydantic import ValidationError

from blink.ingress.errors import APIError
from blink.ingress.generate import choice_deltas, slot_request
from blink.ingress.protocol import CompletionRequest
from blink.ingress.responses import finish_reason
from blink.ingress.state import IngressState
from blink.ingress.structured import grammar_of_body
from blink.ingress.validation import check_model, check_token_ids, completion_prompts, context_room
from blink.shared.sockets import unlink_ipc

log = structlog.get_logger()


class ZmqApi:
    def __init__(self, state: IngressState, endpoint: str):
        self.state, self.endpoint = state, endpoint
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Never drop a reply for a slow reader (the default high-water mark would), and learn when a client is
        # gone (ROUTER_MANDATORY raises instead of discarding), so its request is cancelled.
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, state.max_request_bytes)
        self._tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        self._sock.bind(self.endpoint)
        log.info("zmq api listening", endpoint=self.endpoint)
        try:
            while True:
                frames = await self._sock.recv_multipart()
                task = asyncio.create_task(self._handle(frames[0], frames[-1]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            self._sock.close()
            unlink_ipc(self.endpoint)

    async def _send(self, identity: bytes, body: dict) -> None:
        await self._sock.send_multipart([identity, b"", json.dumps(body).encode()])

    async def _handle(self, identity: bytes, frame: bytes) -> None:
        request_id = None
        try:
            raw = json.loads(frame)
            if not isinstance(raw, dict):
                raise APIError(400, "the request must be a JSON object")
            request_id = raw.pop("id", None)
            self._check_key(raw.pop("api_key", None))
            raw.setdefault("model", self.state.info.model)
            body = CompletionRequest.model_validate(raw)
            await self._generate(identity, request_id, body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            await self._error(identity, request_id, APIError(400, "the request is not valid JSON", code="invalid_json"))
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            await self._error(identity, request_id, APIError(400, f"{param}: {first['msg']}", param=param))
        except APIError as e:
            await self._error(identity, request_id, e)
        except zmq.ZMQError:
            log.info("zmq client gone", request_id=request_id)  # the choice's generator cancelled the request
        except Exception:
            log.exception("zmq request failed", request_id=request_id)
            await self._error(identity, request_id, APIError(500, "internal error", "internal_error"))

    def _check_key(self, given: object) -> None:
        key = self.state.api_key
        if key is not None and not (isinstance(given, str) and secrets.compare_digest(given.encode(), key.encode())):
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    async def _error(self, identity: bytes, request_id, e: APIError) -> None:
        await self._send(identity, {"id": request_id, "error": {"message": e.message, "type": e.type,
                                                                 "param": e.param, "code": e.code}})

    async def _generate(self, identity: bytes, request_id, body: CompletionRequest) -> None:
        state = self.state
        if state.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="draining")
        check_model(state, body.model)
        if body.n != 1 or (isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int)):
            raise APIError(400, "the ZeroMQ API takes one prompt and n=1 per request", param="prompt")
        # What its chunks (text, token ids, a finish reason) cannot carry is refused, not computed and dropped.
        asked = {"echo": body.echo, "prompt_logprobs": body.prompt_logprobs is not None,
                 "logprobs": body.logprobs is not None,
                 "stream_options": body.stream_options is not None and body.stream_options.include_usage}
        if unsupported := [name for name, given in asked.items() if given]:
            raise APIError(400, f"the ZeroMQ API does not take {unsupported[0]} (the HTTP API does)",
                           param=unsupported[0])
        check_token_ids(state, [int(t) for t in body.logit_bias or ()], "logit_bias")
        grammar = await grammar_of_body(state, body)
        prompt = (await completion_prompts(state, body))[0]
        room = context_room(state, prompt, body.max_tokens, "prompt")
        seed = body.seed if body.seed is not None else state.seeds.getrandbits(63)
        request = slot_request(prompt, body, body.max_tokens, room, body.logprobs, seed, state.classes,
                               state.sampling_defaults, grammar=grammar)
        deltas = choice_deltas(state.client, state.tokenizer, request, body, 0, state.metrics, state.info.eos_token_ids)
        async with contextlib.aclosing(deltas):  # a client gone (a failed send) cancels the request now
            async for delta in deltas:
                await self._send(identity, {"id": request_id, "text": delta.text, "token_ids": delta.token_ids,
                                            "finish_reason": finish_reason(delta.finish)})
