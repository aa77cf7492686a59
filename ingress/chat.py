"""Chat prompts from the checkpoint's jinja2 chat template, rendered in a sandbox."""

from __future__ import annotations

import json
from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from blink.ingress.errors import APIError
from blink.ingress.protocol import ChatMessage
from blink.shared.tokenizer import Tokenizer


@lru_cache(maxsize=4)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _message(m: ChatMessage) -> dict:
    """A message as chat templates read it: its text, and its other fields (tool_calls, tool_call_id, name) as
    given, except that a tool call's arguments are a mapping, as templates (and vLLM) hand them over."""
    message = {**(m.model_extra or {}), "role": m.role, "content": m.text()}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message["tool_calls"] = [_with_decoded_arguments(c) for c in calls]
    return message


def _with_decoded_arguments(call: object) -> object:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        except ValueError:
            pass
    return call


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> str:
    template = _compile(tokenizer.chat_template)
    try:
        return template.render(messages=[_message(m) for m in messages], tools=tools,
                               add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens)
    except TemplateError as e:
        raise APIError(400, f"the chat template rejected the messages: {str(e)[:200]}", param="messages") from e
