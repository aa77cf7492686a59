"""How one request is sent and timed: OpenAI completions or chat over HTTP (SSE), or Blink's ZeroMQ API.

Every backend turns a SampleRequest into a RequestRecord: when it was sent, when each chunk of output arrived,
when the stream ended, how many tokens came back, or why it failed. Prompt lengths are the client tokenizer's,
as in vLLM's benchmark, so that every backend counts them alike. A request that fails is recorded, never
dropped: a non-200 answer, an error event in the stream, a stream that ends without a finish reason, a timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import zmq
import zmq.asyncio

from blink.bench.lib.dataset import SampleRequest


@dataclass
class RequestRecord:
    prompt_len: int
    start: float = 0.0  # time.perf_counter() when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # one per chunk that carried output
    end: float = 0.0
    output_len: int = 0
    error: str | None = None
    service_class: str | None = None  # the class the request was sent with, for per-class figures
    constrained: bool = False  # it asked for a structured output: the constrained requests' figures

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RequestOptions:
    model: str
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    class_slos_ms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # class -> {"ttft": ms, ...}
    logprobs: int | None = None  # top logprobs per token to ask for (vLLM's --logprobs)


def class_fields(sample: SampleRequest, options: RequestOptions) -> dict[str, object]:
    """The body fields naming the request's class and that class's SLOs, so that the server judges a request by
    the same thresholds as the benchmark's figures do; none for a request without a class."""
    if sample.service_class is None:
        return {}
    slos = options.class_slos_ms.get(sample.service_class, {})
    return {"service_class": sample.service_class, **{f"{metric}_slo_ms": ms for metric, ms in slos.items()}}


def structured_fields(sample: SampleRequest) -> dict[str, object]:
    """The body field of a request asking for a structured output; none for a plain one."""
    return {} if sample.structured is None else {"structured_outputs": sample.structured}


class Backend(Protocol):
    async def __call__(self, sample: SampleRequest) -> RequestRecord: ...

    async def aclose(self) -> None: ...


class OpenAIBackend:
    """/v1/completions (`chat=False`) or /v1/chat/completions, streamed with usage in the last chunk."""

    def __init__(self, base_url: str, options: RequestOptions, chat: bool, api_key: str | None = None):
        self.url = f"{base_url.rstrip('/')}/v1/{'chat/completions' if chat else 'completions'}"
        self.options, self.chat = options, chat
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(timeout=options.timeout_s, headers=headers,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    def body(self, sample: SampleRequest) -> dict:
        o = self.options
        body = {"model": o.model, "max_tokens": sample.output_len, "temperature": o.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": sample.prompt}]
        else:  # as tokens where the dataset drew tokens: the server sees exactly the length drawn
            body["prompt"] = sample.prompt_ids if sample.prompt_ids is not None else sample.prompt
        if o.logprobs is not None:
            body["logprobs"] = o.logprobs
            if self.chat:
                body["logprobs"], body["top_logprobs"] = True, o.logprobs
        if o.ignore_eos and sample.structured is None:  # vLLM's extension; a grammar decides its own end
            body["ignore_eos"] = True
        return body | class_fields(sample, o) | structured_fields(sample)

    async def __call__(self, sample: SampleRequest) -> RequestRecord:
        record = RequestRecord(sample.prompt_len, start=time.perf_counter(), service_class=sample.service_class,
                               constrained=sample.structured is not None)
        try:
            async with asyncio.timeout(self.options.timeout_s):  # httpx's own timeout is per read, not total
                async with self.client.stream("POST", self.url, json=self.body(sample)) as response:
                    if response.status_code != 200:
                        await response.aread()
                        record.error = f"HTTP {response.status_code}: {error_message(response.text)}"
                    else:
                        record.error = await self._read_stream(response, record)
        except TimeoutError:
            record.error = f"no finish within {self.options.timeout_s} s"
        except Exception as e:  # a malformed stream, a refused connection: this request failed, not the run
            record.error = f"{type(e).__name__}: {e}"
        record.end = time.perf_counter()
        return record

    async def _read_stream(self, response: httpx.Response, record: RequestRecord) -> str | None:
        """Reads the SSE stream into `record`; returns why it failed, or None."""
        finished = done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return f"error event: {error_message(json.dumps(event))}"
            if choices := event.get("choices"):
                record.chunk_times.append(time.perf_counter())
                finished = finished or choices[0].get("finish_reason") is not None
            if usage := event.get("usage"):
                record.output_len = usage.get("completion_tokens") or 0
        if not (finished and done):
            return "stream ended before its finish reason and [DONE]"
        if record.output_len == 0:  # a server that sends no usage: one token per chunk, as such servers stream
            record.output_len = len(record.chunk_times)
        return None

    async def aclose(self) -> None:
        await self.client.aclose()


class ZmqBackend:
    """Blink's ZeroMQ API; one DEALER socket per request, as the client requires."""

    def __init__(self, endpoint: str, options: RequestOptions, api_key: str | None = None):
        from blink.ingress.zmq_client import AsyncClient, BlinkError

        if endpoint.startswith("ipc://") and not Path(endpoint.removeprefix("ipc://")).exists():
            raise SystemExit(f"{endpoint}: no such socket; is the ingress running with this deployment name?")
        self.endpoint, self.options, self.api_key = endpoint, options, api_key
        self._client_class, self._error_class = AsyncClient, BlinkError
        zmq.asyncio.Context.instance().set(zmq.MAX_SOCKETS, 1 << 16)  # a socket per request in flight

    async def __call__(self, sample: SampleRequest) -> RequestRecord:
        record = RequestRecord(sample.prompt_len, start=time.perf_counter(), service_class=sample.service_class,
                               constrained=sample.structured is not None)
        params = {"max_tokens": sample.output_len, "temperature": self.options.temperature,
                  "ignore_eos": self.options.ignore_eos and sample.structured is None,
                  **class_fields(sample, self.options), **structured_fields(sample)}
        client = None
        try:
            client = self._client_class(self.endpoint, api_key=self.api_key)
            async with asyncio.timeout(self.options.timeout_s):
                async for chunk in client.stream(sample.prompt, **params):
                    record.chunk_times.append(time.perf_counter())
                    record.output_len += len(chunk.token_ids)
        except self._error_class as e:
            record.error = f"{e.error.get('type', 'error')}: {e}"
        except TimeoutError:
            record.error = f"no finish within {self.options.timeout_s} s"
        except Exception as e:  # out of sockets or descriptors: this request failed, not the run
            record.error = f"{type(e).__name__}: {e}"
        finally:
            if client is not None:
                client.close()
        record.end = time.perf_counter()
        return record

    async def aclose(self) -> None:
        pass


def error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]
