"""Deltas into OpenAI's response bodies: a stream's chunks (server-sent events) or a whole response's choices,
with logprobs in each endpoint's format, completions' echo, vLLM's prompt_logprobs, and chat's reasoning and tool
calls."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from blink.ingress.chat_output import ChoiceText
from blink.ingress.errors import APIError
from blink.ingress.generate import Delta
from blink.ingress.reasoning import ReasoningParser
from blink.ingress.tools import ToolParser
from blink.shared.slot_table import FINISH_NAMES, Finish
from blink.shared.tokenizer import Tokenizer


def finish_reason(finish: Finish) -> str | None:
    """OpenAI's finish_reason for how a choice ended; None while it goes on."""
    return FINISH_NAMES.get(finish)


@dataclass
class Shape:
    """Deltas into OpenAI's chunks and choices. For completions' echo, a choice's first chunk starts with its prompt
    (text, and tokens with their logprobs when asked); text_offset counts characters from the choice's start."""

    id: str
    created: int
    model: str
    chat: bool
    tokenizer: Tokenizer
    wants_logprobs: bool
    prompt_logprobs: int | None  # vLLM's prompt_logprobs, as the body asked
    echo: dict[int, tuple[str, list[int]]] | None  # choice index -> its prompt's text and tokens
    tools: ToolParser | None = None  # finds tool calls in chat choices
    reasoning: ReasoningParser | None = None  # splits their think block out
    thinking: bool = False  # the prompt left the output inside a think block
    _texts: dict[int, ChoiceText] = field(default_factory=dict)
    _started: set[int] = field(default_factory=set)  # choices whose first chunk went out
    _offsets: dict[int, int] = field(default_factory=dict)  # characters of each choice's text so far

    def logprobs(self, delta: Delta, first: bool) -> dict | None:
        if not self.wants_logprobs:
            return None
        tok = self.tokenizer.id_to_token
        if self.chat:
            if not delta.logprobs:
                return None
            return {"content": [{"token": tok(lp.token_id), "logprob": lp.logprob, "bytes": None,
                                 "top_logprobs": [{"token": tok(t), "logprob": v, "bytes": None} for t, v in lp.top]}
                                for lp in delta.logprobs]}
        ids = [lp.token_id for lp in delta.logprobs]
        lps: list[float | None] = [lp.logprob for lp in delta.logprobs]
        tops: list[dict | None] = [{tok(t): v for t, v in lp.top} | {tok(lp.token_id): lp.logprob}
                                   for lp in delta.logprobs]
        if first and self.echo is not None:  # the prompt's first token has no logprob
            scored = delta.prompt or []
            ids = [self.echo[delta.index][1][0], *(lp.token_id for lp in scored), *ids]
            lps = [None, *(lp.logprob for lp in scored), *lps]
            tops = [None, *({tok(t): v for t, v in lp.top} | {tok(lp.token_id): lp.logprob} for lp in scored), *tops]
        if not ids:
            return None
        pieces = self.tokenizer.raw.decode_batch([[t] for t in ids], skip_special_tokens=False)
        offset = self._offsets.get(delta.index, 0)
        offsets = []
        for piece in pieces:
            offsets.append(offset)
            offset += len(piece)
        self._offsets[delta.index] = offset
        return {"tokens": [tok(t) for t in ids], "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def vllm_prompt_logprobs(self, delta: Delta) -> list[dict | None] | None:
        """vLLM's prompt_logprobs field: per prompt token, {id: {logprob, rank, decoded_token}} (the first None)."""
        if self.prompt_logprobs is None or delta.prompt is None:
            return None

        # Each distinct token decoded once, in one batch call: a long prompt with top 20 names thousands of tokens.
        ids = sorted({t for lp in delta.prompt for t in (lp.token_id, *(t for t, _ in lp.top))})
        text = dict(zip(ids, self.tokenizer.raw.decode_batch([[t] for t in ids], skip_special_tokens=False),
                        strict=True))

        def entry(lp) -> dict:
            ranked = [t for t, _ in lp.top]
            rank = ranked.index(lp.token_id) + 1 if lp.token_id in ranked else None
            top = {str(t): {"logprob": v, "rank": r, "decoded_token": text[t]}
                   for r, (t, v) in enumerate(lp.top[:self.prompt_logprobs], 1)}
            return top | {str(lp.token_id): {"logprob": lp.logprob, "rank": rank, "decoded_token": text[lp.token_id]}}

        return [None, *(entry(lp) for lp in delta.prompt)]

    def choice(self, delta: Delta) -> dict:
        first = delta.index not in self._started
        self._started.add(delta.index)
        text = delta.text
        if first and self.echo is not None:
            text = self.echo[delta.index][0] + text
        choice = {"index": delta.index, "logprobs": self.logprobs(delta, first),
                  "finish_reason": finish_reason(delta.finish)}
        if (scored := self.vllm_prompt_logprobs(delta)) is not None:
            choice["prompt_logprobs"] = scored
        if self.chat:
            choice["message" if delta.whole else "delta"] = self.message(delta, text, choice)
        else:
            choice["text"] = text
        return choice

    def message(self, delta: Delta, text: str, choice: dict) -> dict:
        """A chat choice's message (or a stream's delta of it): reasoning, content and tool calls."""
        if self.tools is None and self.reasoning is None:
            return {"role": "assistant", "content": text}
        split = self._texts.setdefault(delta.index, ChoiceText(self.reasoning, self.thinking, self.tools))
        parts = split.finish(text) if delta.finish else split.push(text)
        message: dict = {"role": "assistant", "content": parts.content}
        if self.reasoning is not None and (parts.reasoning or delta.whole):
            message["reasoning_content"] = parts.reasoning or None  # vLLM's field; null in a whole answer without
        if parts.calls:
            message["tool_calls"] = [c.as_openai(None if delta.whole else i) for i, c in enumerate(parts.calls)]
            choice["finish_reason"] = "tool_calls"
        if delta.whole and not parts.content and (parts.calls or parts.reasoning):
            message["content"] = None  # as OpenAI answers a message that only calls tools, vLLM one that only thinks
        return message

    def chunk(self, delta: Delta) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [self.choice(delta)]}


async def sse(shape: Shape, first: Delta | None, deltas: AsyncIterator[Delta],
               prompt_tokens: int, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    """include_usage: a last chunk with the usage; continuous_usage: every chunk with the usage so far."""
    completion_tokens = cached_tokens = 0
    try:
        delta = first
        try:
            while delta is not None:
                completion_tokens += len(delta.token_ids)
                cached_tokens += delta.cached_tokens
                chunk = shape.chunk(delta)
                if continuous_usage:
                    chunk["usage"] = _usage(prompt_tokens, completion_tokens, cached_tokens)
                yield f"data: {json.dumps(chunk)}\n\n"
                delta = await anext(deltas, None)
        except APIError as e:  # after the headers went out: an error event, as vLLM sends, then the end
            error = {"message": e.message, "type": e.type, "param": e.param, "code": e.code}
            yield f"data: {json.dumps({'error': error})}\n\n"
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            usage = _usage(prompt_tokens, completion_tokens, cached_tokens)
            kind = "chat.completion.chunk" if shape.chat else "text_completion"
            yield f"data: {json.dumps({'id': shape.id, 'object': kind, 'created': shape.created, 'model': shape.model, 'choices': [], 'usage': usage})}\n\n"  # noqa: E501
        yield "data: [DONE]\n\n"
    finally:
        await deltas.aclose()


def collect(shape: Shape, first: Delta | None, rest: list[Delta], num_choices: int, prompt_tokens: int) -> dict:
    deltas = ([first] if first else []) + rest
    by_index: dict[int, list[Delta]] = {}
    for delta in deltas:
        by_index.setdefault(delta.index, []).append(delta)
    choices, completion_tokens = [], 0
    for index in range(num_choices):
        parts = by_index.get(index, [])
        whole = Delta(index, "".join(d.text for d in parts), [t for d in parts for t in d.token_ids],
                      [lp for d in parts for lp in d.logprobs],
                      next((d.finish for d in reversed(parts) if d.finish), Finish.NONE),
                      next((d.prompt for d in parts if d.prompt is not None), None), whole=True)
        completion_tokens += len(whole.token_ids)
        choices.append(shape.choice(whole))
    return {"id": shape.id, "object": "chat.completion" if shape.chat else "text_completion",
            "created": shape.created, "model": shape.model, "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens, sum(d.cached_tokens for d in deltas))}


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage, with the prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
