"""Chat prompts from the checkpoint's jinja2 chat template, rendered in a sandbox."""

from __future__ import annotations

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


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
    template = _compile(tokenizer.chat_template)
    try:
        return template.render(messages=[{"role": m.role, "content": m.text()} for m in messages],
                               add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens)
    except TemplateError as e:
        raise APIError(400, f"the chat template rejected the messages: {str(e)[:200]}", param="messages") from e
