"""One request's choices: publish each into a slot, turn its tokens into text deltas, merge the choices."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from blink.ingress.client import IngressClient, Overloaded
from blink.ingress.detokenize import Detokenizer
from blink.ingress.errors import APIError, overloaded
from blink.ingress.generation_config import SamplingDefaults
from blink.ingress.metrics import ChoiceRecord, Metrics
from blink.ingress.protocol import SamplingFields
from blink.shared.request_schema import request_of
from blink.shared.service_class import ClassDefaults, ServiceClass
from blink.shared.slot_table import Finish, Request, RequestStats, TokenLogprob
from blink.shared.tokenizer import Tokenizer

log = structlog.get_logger()

@dataclass
class Delta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finish = Finish.NONE  # how the choice ended, as the slot table says it (OpenAI's word: responses)
    prompt: list[TokenLogprob] | None = None  # the prompt's tokens after the first, scored, when asked: all at once
    whole: bool = False  # a whole choice (the deltas merged), not a chunk of a stream
    cached_tokens: int = 0  # with the finish of a choice that counts its prompt: what the prefix cache held of it


def slot_request(prompt: list[int], fields: SamplingFields, max_tokens: int | None, room: int,
                 logprobs: int | None, seed: int, classes: ClassDefaults, sampling: SamplingDefaults,
                 named_class: str | None = None, prompt_logprobs: int | None = None) -> Request:
    """The request as the slot carries it, with the defaults of what the body did not give: its class's SLOs, the
    checkpoint's sampling defaults, and max_tokens (the generation config's within the context's `room`).
    named_class: the x-blink-class header's, which the body's field overrides."""
    service_class, ttft, tpot = classes.resolve(fields.service_class or named_class, fields.ttft_slo_ms,
                                                fields.tpot_slo_ms)
    max_tokens = sampling.max_tokens_within(room) if max_tokens is None else max_tokens
    return request_of(sampling.fill(fields), prompt, max_tokens, seed, int(service_class), ttft, tpot, logprobs,
                      prompt_logprobs, fields.cache_salt or "")


def engine_failed() -> APIError:
    return APIError(503, "the engine serving this request failed before finishing it; retry it",
                    "service_unavailable", code="engine_failure")


async def choice_deltas(client: IngressClient, tokenizer: Tokenizer, request: Request, fields: SamplingFields,
                        index: int, metrics: Metrics, eos_token_ids: list[int],
                        counts_prompt: bool = True) -> AsyncIterator[Delta]:
    """Streams one choice. A token that stops the request (a stop id, or eos) keeps its id but, as in vLLM,
    not its text unless include_stop_str_in_output; counts_prompt is False for a prompt's later choices."""
    detok = Detokenizer(tokenizer.raw, fields.stop, fields.include_stop_str_in_output, fields.skip_special_tokens,
                        fields.min_tokens)
    silent_stops = set() if fields.include_stop_str_in_output else set(request.stop_token_ids) | (
        set() if request.ignore_eos else set(eos_token_ids))
    try:
        stream = await client.submit(request)
    except Overloaded:  # a 429 before the first byte; after it (a later choice), a stream's error event
        raise overloaded() from None
    k = max(request.logprobs, 0)
    # The engine publishes the prompt's tokens after the first, scored, ahead of the generated ones.
    prompt: list[TokenLogprob] = []
    prompt_left = len(request.prompt) - 1 if request.prompt_logprobs >= 0 else 0
    of_class = metrics.of(ServiceClass(request.service_class))
    first_at = last_at = None
    stats: RequestStats | None = None
    generated, finish = 0, Finish.ABORT  # stays ABORT if the consumer leaves first
    outputs = client.outputs(stream)
    try:
        async for out in outputs:
            now = time.monotonic()
            delta = Delta(index)
            for i, token in enumerate(out.tokens):
                if prompt_left:
                    top = zip(out.top_ids[i][:request.prompt_logprobs], out.top_logprobs[i][:request.prompt_logprobs],
                              strict=True)
                    prompt.append(TokenLogprob(token, out.logprobs[i], list(top)))
                    prompt_left -= 1
                    if not prompt_left:
                        delta.prompt = prompt
                    continue
                generated += 1
                delta.token_ids.append(token)
                if request.logprobs >= 0:
                    top = list(zip(out.top_ids[i][:k], out.top_logprobs[i][:k], strict=True))
                    delta.logprobs.append(TokenLogprob(token, out.logprobs[i], top))
                # The engine ends a request on the token that stops it, so it is the last one, even when its
                # finish comes in a later read (the engine publishes the token, then the finish).
                if token in silent_stops:
                    break
                piece = detok.push(token)
                delta.text += piece.text
                if piece.stopped:
                    delta.finish = Finish.STOP
                    break
            stats = out.stats or stats
            if delta.token_ids:
                if first_at is None:
                    first_at = now
                    of_class.ttft.observe(now - stream.submitted_at)
                elif last_at is not None:
                    of_class.itl.observe((now - last_at) / len(delta.token_ids))
                last_at = now
            if out.finish == Finish.FAILED:
                if delta.text or delta.token_ids or delta.prompt:
                    yield delta
                finish = Finish.FAILED
                raise engine_failed()
            if delta.finish == Finish.NONE and out.finish != Finish.NONE:
                tail = detok.flush()
                delta.text += tail.text
                delta.finish = Finish.STOP if tail.stopped else out.finish
            if out.stats is not None and counts_prompt:
                delta.cached_tokens = out.stats.cached_tokens
            finish = delta.finish or finish
            if delta.text or delta.token_ids or delta.finish or delta.prompt:
                yield delta
            if delta.finish:
                break
    finally:
        await outputs.aclose()  # cancels the slot's request when the choice ended early
        metrics.finished(stream, ChoiceRecord(
            ServiceClass(request.service_class), generated, len(request.prompt) if counts_prompt else 0,
            ttft_s=None if first_at is None else first_at - stream.submitted_at,
            tpot_s=(last_at - first_at) / (generated - 1) if first_at is not None and generated > 1 else None,
            ttft_slo_ms=_finite(request.ttft_slo_ms), tpot_slo_ms=_finite(request.tpot_slo_ms),
            outcome=finish, stats=stats))
        log.info("choice finished", choice=index, slot=stream.slot, prompt_tokens=len(request.prompt),
                 generated=generated, finish_reason=finish.name.lower(),
                 latency_s=round(time.monotonic() - stream.submitted_at, 4))


def _finite(ms: float) -> float | None:
    return ms if math.isfinite(ms) else None


async def merged(choices: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Interleaves the choices' deltas as they come."""
    if len(choices) == 1:
        async with contextlib.aclosing(choices[0]) as choice:  # closed now, not when collected: cancels the request
            async for delta in choice:
                yield delta
        return
    queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

    async def pump(choice: AsyncIterator[Delta]) -> None:
        try:
            async for delta in choice:
                await queue.put(delta)
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
