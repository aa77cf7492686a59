"""Checks both APIs make before a request takes a slot."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from blink.ingress.chat import render_chat
from blink.ingress.errors import APIError
from blink.ingress.protocol import ChatRequest, CompletionRequest, NamedToolChoice
from blink.ingress.state import IngressState
from blink.ingress.tools import FirstCallOnly, ForcedParser, ToolParser
from blink.shared.tokenizer import TokenizerError

T = TypeVar("T")


def check_model(state: IngressState, model: str) -> None:
    names = state.info.served_model_names
    if model not in names:
        served = ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
        raise APIError(404, f"the model {model[:100]!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")


def check_token_ids(state: IngressState, ids: list[int], param: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= state.info.vocab_size):
        raise APIError(400, f"token ids must be in [0, {state.info.vocab_size})", param=param)


def check_text_fits(state: IngressState, text: str, param: str) -> None:
    """Refuses, without tokenizing it, a text that cannot fit in the context whatever its tokens."""
    limit = state.info.max_model_len
    if state.tokenizer.surely_longer_than(text, limit):
        raise APIError(400, f"this model's maximum context length is {limit} tokens, and a text of {len(text)} "
                       "characters is longer", param=param, code="context_length_exceeded")


def _check_ids_fit(state: IngressState, ids: list[int], param: str) -> None:
    if len(ids) >= state.info.max_model_len:  # before checking each id: a long list costs the loop time
        context_room(state, ids, None, param)
    check_token_ids(state, ids, param)


async def completion_prompts(state: IngressState, body: CompletionRequest) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        texts = [p] if isinstance(p, str) else list(p)
        for text in texts:
            check_text_fits(state, text, "prompt")
        prompts = await encode(state, lambda: [state.tokenizer.encode(text) for text in texts], "prompt")
    elif p and isinstance(p[0], list):
        prompts = [list(x) for x in p]
    else:
        prompts = [list(p)]
    if not prompts or any(not x for x in prompts):
        raise APIError(400, "the prompt is empty", param="prompt")
    for x in prompts:
        _check_ids_fit(state, x, "prompt")
    return prompts


async def chat_prompt(state: IngressState, body: ChatRequest) -> tuple[list[int], str]:
    """The prompt's tokens, and its text (where the reasoning parser sees whether it opened a think block)."""
    if state.chat_template is None and state.tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template (--chat-template gives one)", param="messages")
    check_text_fits(state, "".join(m.text() for m in body.messages), "messages")

    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    kwargs = {**state.default_chat_template_kwargs, **(body.chat_template_kwargs or {})}

    def render() -> tuple[list[int], str]:
        text = render_chat(state.tokenizer, body.messages, body.add_generation_prompt, tools, state.chat_template,
                           kwargs)
        return state.tokenizer.encode(text, add_special_tokens=False), text

    return await encode(state, render, "messages")


async def encode(state: IngressState, tokenize: Callable[[], T], param: str) -> T:
    """Runs `tokenize` off the event loop; text the tokenizer refuses (not valid Unicode) is a 400 on `param`."""
    try:
        return await state.off_loop(tokenize)
    except TokenizerError as e:
        raise APIError(400, str(e), param=param) from None


def chat_tool_parser(state: IngressState, body: ChatRequest) -> ToolParser | None:
    """The parser that finds tool calls in this request's output (None: its output is all content). A forced call
    ("required", or a named function) is read whole as the calls its grammar made (blink.ingress.structured); with
    parallel_tool_calls false, only the first call the model writes is answered."""
    choice = body.tool_choice
    if choice not in (None, "none") and not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "required" or isinstance(choice, NamedToolChoice):
        return ForcedParser(choice.function.name if isinstance(choice, NamedToolChoice) else None)
    if not body.tools or choice == "none":
        return None
    if state.tool_parser is None:
        raise APIError(400, "\"auto\" tool choice requires the server to run with --enable-auto-tool-choice and "
                       "--tool-call-parser", param="tool_choice")
    return FirstCallOnly(state.tool_parser) if body.parallel_tool_calls is False else state.tool_parser


def context_room(state: IngressState, prompt: list[int], max_tokens: int | None, prompt_param: str) -> int:
    """Tokens the request may generate; 400 context_length_exceeded when prompt plus max_tokens do not fit."""
    limit = state.info.max_model_len
    room = limit - len(prompt)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = max_tokens if max_tokens is not None else 1
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but {len(prompt)} prompt "
                       f"tokens and {asked} completion tokens were requested",
                       param="max_tokens" if room >= 1 else prompt_param, code="context_length_exceeded")
    return room
