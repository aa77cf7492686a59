"""Chat prompts from the checkpoint's jinja2 chat template (or --chat-template's), rendered in a sandbox with the
request's chat_template_kwargs."""

from __future__ import annotations

import codecs
import json
from functools import lru_cache
from pathlib import Path

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


def load_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a file's text, else the template itself, its backslash escapes decoded (so
    a shell's `\\n` is a newline); a value with none of `{`, `}` or a newline is a file that could not be read."""
    try:
        source = Path(value).read_text()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the value
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value[:200]!r}: cannot read it ({e})") from None
        try:
            source = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
        except UnicodeDecodeError as e:  # a dangling backslash
            raise ValueError(f"--chat-template: {e.reason}") from None
    try:
        _compile(source)
    except TemplateError as e:
        raise ValueError(f"--chat-template is not a Jinja template: {e}") from None
    return source


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                tools: list[dict] | None = None, template: str | None = None, kwargs: dict | None = None) -> str:
    """template: used instead of the tokenizer's (--chat-template); kwargs: more variables for it (the request's
    chat_template_kwargs over --default-chat-template-kwargs), which may replace the special tokens, never what the
    request itself gives."""
    variables = {**tokenizer.special_tokens, **(kwargs or {}), "messages": [_message(m) for m in messages],
                 "tools": tools, "add_generation_prompt": add_generation_prompt}
    try:
        return _compile(template or tokenizer.chat_template).render(variables)
    except TemplateError as e:
        raise APIError(400, f"the chat template rejected the messages: {str(e)[:200]}", param="messages") from e
    except Exception as e:  # a kwarg of a type the template cannot use (a number added to a string...)
        raise APIError(400, f"the chat template failed with these messages and chat_template_kwargs: "
                       f"{type(e).__name__}: {str(e)[:200]}", param="chat_template_kwargs") from e
