"""OpenAI's `/v1/responses`, stateless, translated onto the chat path.

The body becomes a `ChatRequest` (`as_chat`: instructions as the system message, input items as messages and tool
turns, function tools, `text.format` as `response_format`), which the chat route serves as any other; its answer
becomes a response object (`response_object`), or its SSE chunks become the Responses API's typed events
(`response_events`: created, output items and their text or arguments deltas, completed or incomplete), as the
OpenAI SDK's `client.responses.create(stream=True)` reads them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from blink.ingress.errors import APIError
from blink.ingress.protocol import ChatRequest, ResponseFunctionCall, ResponseFunctionOutput, ResponsesRequest


def as_chat(body: ResponsesRequest) -> ChatRequest:
    """The chat request that answers `body`; a 400 when it cannot be one."""
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    for item in [body.input] if isinstance(body.input, str) else body.input:
        if isinstance(item, str):
            messages.append({"role": "user", "content": item})
        elif isinstance(item, ResponseFunctionCall):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                         "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ResponseFunctionOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            messages.append({"role": item.role, "content": item.text()})
    chat: dict = {"model": body.model, "messages": messages, "stream": body.stream,
                  "max_completion_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls,
                  "user": body.user}
    chat.update({k: v for k in ("temperature", "top_p") if (v := getattr(body, k)) is not None})
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    try:
        return ChatRequest.model_validate(chat)
    except ValidationError as e:
        error = e.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "messages"
        raise APIError(400, f"{'.'.join(map(str, error['loc']))}: {error['msg']}",
                       param=_RESPONSES_NAMES.get(field, field)) from None


# The chat request's fields that as_chat names differently: a refusal names the field the client sent.
_RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


def _message(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if text or status == "completed"
            else []}


def _function_call(call: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _response(body: ResponsesRequest, rid: str, created: float, status: str, output: list[dict],
              usage: dict | None) -> dict:
    fmt = body.text.format if body.text and body.text.format else None
    return {
        "id": rid, "object": "response", "created_at": int(created), "status": status, "model": body.model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
        "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "tool_choice": body.tool_choice.model_dump() if body.tool_choice and not isinstance(body.tool_choice, str)
        else body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }


def response_object(body: ResponsesRequest, chat: dict) -> dict:
    """The response for a chat completion (one choice) that answered `body`."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = [_message(message["content"])] if message.get("content") else []
    output += [_function_call(call) for call in message.get("tool_calls") or []]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    return _response(body, f"resp_{uuid.uuid4().hex}", chat["created"], status, output, chat.get("usage"))


async def response_events(body: ResponsesRequest, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
    """The Responses API's stream from the chat stream's SSE chunks (closed with it: a client that leaves cancels
    the request)."""
    try:
        async for line in _events(body, chunks):
            yield line
    finally:
        await chunks.aclose()


async def _events(body: ResponsesRequest, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
    rid, created, seq = f"resp_{uuid.uuid4().hex}", time.time(), 0
    output: list[dict] = []
    text, message_at, finish, usage = "", None, None, None

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    def close_message() -> list[str]:
        nonlocal message_at
        if message_at is None:
            return []
        item, at = output[message_at], message_at
        item.update(_message(text, item_id=item["id"]))
        message_at = None
        part = item["content"][0]
        return [event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0, text=text,
                      logprobs=[]),
                event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0, part=part),
                event("response.output_item.done", output_index=at, item=item)]

    yield event("response.created", response=_response(body, rid, created, "in_progress", [], None))
    yield event("response.in_progress", response=_response(body, rid, created, "in_progress", [], None))
    async for data in _sse_data(chunks):
        if "error" in data:  # the chat stream's error event: the response fails
            error = data["error"]
            yield event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
            failed = _response(body, rid, created, "failed", output, usage)
            failed["error"] = {"code": error.get("code") or "server_error", "message": error.get("message")}
            yield event("response.failed", response=failed)
            return
        usage = data.get("usage") or usage
        for choice in data.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("content"):
                if message_at is None:
                    message_at = len(output)
                    output.append(_message("", status="in_progress"))
                    item = output[message_at]
                    yield event("response.output_item.added", output_index=message_at, item=item)
                    yield event("response.content_part.added", item_id=item["id"], output_index=message_at,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                text += delta["content"]
                yield event("response.output_text.delta", item_id=output[message_at]["id"], output_index=message_at,
                            content_index=0, delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls") or []:
                for line in close_message():
                    yield line
                item = _function_call(call)
                at = len(output)
                output.append(item)
                yield event("response.output_item.added", output_index=at,
                            item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                            arguments=item["arguments"])
                yield event("response.output_item.done", output_index=at, item=item)
            finish = choice.get("finish_reason") or finish
    for line in close_message():
        yield line
    status = "incomplete" if finish == "length" else "completed"
    yield event(f"response.{status}", response=_response(body, rid, created, status, output, usage))


async def _sse_data(chunks: AsyncIterator[str | bytes]) -> AsyncIterator[dict]:
    """The JSON of each `data:` line of an SSE stream, [DONE] left out."""
    buffer = ""
    async for chunk in chunks:
        buffer += chunk.decode() if isinstance(chunk, bytes) else chunk
        *events, buffer = buffer.split("\n\n")
        for raw in events:
            for line in raw.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])
