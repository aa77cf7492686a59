"""Checks both APIs make before a request takes a slot."""

from __future__ import annotations

from blink.ingress.errors import APIError
from blink.ingress.protocol import CompletionRequest
from blink.ingress.state import IngressState


def check_model(state: IngressState, model: str) -> None:
    if model != state.info.model:
        raise APIError(400, f"the model {model[:100]!r} does not exist; this server serves {state.info.model!r}",
                       param="model", code="model_not_found")


def check_token_ids(state: IngressState, ids: list[int], param: str) -> None:
    if any(not 0 <= t < state.info.vocab_size for t in ids):
        raise APIError(400, f"token ids must be in [0, {state.info.vocab_size})", param=param)


def completion_prompts(state: IngressState, body: CompletionRequest) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str):
        prompts = [state.tokenizer.encode(p)]
    elif p and isinstance(p[0], str):
        prompts = [state.tokenizer.encode(s) for s in p]
    elif p and isinstance(p[0], list):
        prompts = [list(x) for x in p]
    else:
        prompts = [list(p)]
    if not prompts or any(not x for x in prompts):
        raise APIError(400, "the prompt is empty", param="prompt")
    for x in prompts:
        check_token_ids(state, x, "prompt")
    return prompts


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
