"""A small client for the ingress's ZeroMQ API, sync and asyncio. Needs only pyzmq."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import zmq
import zmq.asyncio


class BlinkError(Exception):
    def __init__(self, error: dict):
        super().__init__(error.get("message"))
        self.error = error


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None


def _request(prompt: str | list[int], params: dict, api_key: str | None) -> tuple[str, bytes]:
    request_id = uuid.uuid4().hex
    key = {"api_key": api_key} if api_key is not None else {}
    return request_id, json.dumps({"id": request_id, "prompt": prompt, **key, **params}).encode()


def _chunk(request_id: str, frame: bytes) -> Chunk | None:
    body = json.loads(frame)
    if body.get("id") != request_id:
        return None  # a reply to an earlier, abandoned request
    if "error" in body:
        raise BlinkError(body["error"])
    return Chunk(body["text"], body["token_ids"], body["finish_reason"])


class Client:
    """`for chunk in Client(endpoint).stream("Hello", max_tokens=8): ...`"""

    def __init__(self, endpoint: str, timeout_s: float = 60.0, api_key: str | None = None):
        self.api_key = api_key
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self.timeout_ms = int(timeout_s * 1000)

    def stream(self, prompt: str | list[int], **params) -> Iterator[Chunk]:
        request_id, frame = _request(prompt, params, self.api_key)
        self._sock.send_multipart([b"", frame])
        while True:
            if not self._sock.poll(self.timeout_ms):
                raise TimeoutError("no answer from the ingress")
            chunk = _chunk(request_id, self._sock.recv_multipart()[-1])
            if chunk is not None:
                yield chunk
                if chunk.finish_reason:
                    return

    def generate(self, prompt: str | list[int], **params) -> Chunk:
        parts = list(self.stream(prompt, **params))
        return Chunk("".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
                     parts[-1].finish_reason)

    def close(self) -> None:
        self._sock.close()


class AsyncClient:
    """One request at a time per client; open one client per concurrent stream."""

    def __init__(self, endpoint: str, api_key: str | None = None):
        self.api_key = api_key
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)

    async def stream(self, prompt: str | list[int], **params) -> AsyncIterator[Chunk]:
        request_id, frame = _request(prompt, params, self.api_key)
        await self._sock.send_multipart([b"", frame])
        while True:
            chunk = _chunk(request_id, (await self._sock.recv_multipart())[-1])
            if chunk is not None:
                yield chunk
                if chunk.finish_reason:
                    return

    def close(self) -> None:
        self._sock.close()
