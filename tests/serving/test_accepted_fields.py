"""Fields the edges accept must be applied, or refused with a 400: none may be taken and then silently ignored.

In process, without an engine: each refusal or application here happens before a request would take a slot."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio
from pydantic import ValidationError

from blink.ingress.errors import APIError
from blink.ingress.protocol import ChatRequest, ResponsesRequest
from blink.ingress.responses_api import as_chat
from blink.ingress.tools import HermesParser, ToolStream
from blink.ingress.validation import chat_tool_parser
from blink.ingress.zmq_api import ZmqApi

MODEL = "m"
CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


def _chat(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}], **fields})


@pytest.mark.parametrize("parallel", [None, True, False])
def test_parallel_tool_calls_false_keeps_one_auto_call(parallel):
    """OpenAI (and vLLM) answer at most one tool call when parallel_tool_calls is false; auto tool choice too."""
    parser = chat_tool_parser(SimpleNamespace(tool_parser=HermesParser()), _chat(parallel_tool_calls=parallel))
    stream = ToolStream(parser)
    assert stream.push(CALL + CALL) == ""
    content, calls = stream.finish()
    assert content == ""
    assert [c.name for c in calls] == ["f"] * (1 if parallel is False else 2)


@pytest.mark.parametrize("fmt", [
    {"type": "json_object", "schema": {"type": "object", "required": ["a"]}},
    {"type": "text", "schema": {"type": "object"}},
    {"type": "text", "name": "x"},
    {"type": "json_object", "strict": True},
])
def test_responses_text_format_fields_only_with_json_schema(fmt):
    """A schema with text.format's type json_object (or text) was accepted and not followed."""
    with pytest.raises(ValidationError, match="json_schema"):
        ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "text": {"format": fmt}})
    ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "text": {"format": {**fmt, "type": "json_schema"}}})


@pytest.mark.parametrize(("field", "value"), [("temperature", 5), ("top_p", 0)])
def test_responses_refusals_name_the_responses_field(field, value):
    body = ResponsesRequest.model_validate({"model": MODEL, "input": "hi", field: value})
    with pytest.raises(APIError) as refused:
        as_chat(body)
    assert refused.value.status == 400
    assert refused.value.param == field


def _zmq_state() -> SimpleNamespace:
    info = SimpleNamespace(model=MODEL, served_model_names=[MODEL])
    return SimpleNamespace(info=info, api_key=None, max_request_bytes=1 << 20, draining=False)


@pytest.mark.parametrize(("fields", "param"), [
    ({"logprobs": 2}, "logprobs"),
    ({"logprobs": 0}, "logprobs"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_zmq_api_refuses_what_its_chunks_cannot_carry(tmp_path, fields, param):
    """The ZeroMQ API's chunks carry text, token ids and a finish reason: logprobs or a usage asked for were
    computed, or not, and never sent."""
    endpoint = f"ipc://{tmp_path}/zmq.sock"

    async def ask() -> dict:
        serving = asyncio.create_task(ZmqApi(_zmq_state(), endpoint).serve())
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            await sock.send_multipart([b"", json.dumps({"id": "r", "prompt": "hi", **fields}).encode()])
            return json.loads((await asyncio.wait_for(sock.recv_multipart(), 10))[-1])
        finally:
            sock.close()
            serving.cancel()

    reply = asyncio.run(ask())
    assert reply["id"] == "r"
    assert reply["error"]["param"] == param, reply
    assert reply["error"]["type"] == "invalid_request_error"
