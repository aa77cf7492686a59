"""One request's choices: publish each into a slot, turn its tokens into text deltas, merge the choices."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import structlog

from blink.ingress.client import IngressClient, Overloaded, Stream
from blink.ingress.detokenize import Detokenizer
from blink.ingress.errors import APIError, overloaded
from blink.ingress.generation_config import SamplingDefaults
from blink.ingress.metrics import ChoiceRecord, ClassMetrics, Metrics
from blink.ingress.protocol import SamplingFields
from blink.shared.grammar import GrammarSpec
from blink.shared.request_schema import request_of
from blink.shared.service_class import ClassDefaults, ServiceClass
from blink.shared.slot_table import Finish, Output, Request, RequestStats, TokenLogprob
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
                 named_class: str | None = None, prompt_logprobs: int | None = None,
                 grammar: GrammarSpec | None = None, reasoning_end_id: int = -1) -> Request:
    """The request as the slot carries it, with the defaults of what the body did not give: its class's SLOs, the
    checkpoint's sampling defaults, and max_tokens (the generation config's within the context's `room`).
    named_class: the x-blink-class header's, which the body's field overrides; grammar: the structured output's,
    checked (blink.ingress.structured), masking after the token reasoning_end_id (-1: from the first)."""
    service_class, ttft, tpot = classes.resolve(fields.service_class or named_class, fields.ttft_slo_ms,
                                                fields.tpot_slo_ms)
    max_tokens = sampling.max_tokens_within(room) if max_tokens is None else max_tokens
    request = request_of(sampling.fill(fields), prompt, max_tokens, seed, int(service_class), ttft, tpot, logprobs,
                         prompt_logprobs, fields.cache_salt or "", grammar)
    return replace(request, reasoning_end_id=reasoning_end_id) if reasoning_end_id >= 0 else request


def engine_failed() -> APIError:
    return APIError(503, "the engine serving this request failed before finishing it; retry it",
                    "service_unavailable", code="engine_failure")


async def choice_deltas(client: IngressClient, tokenizer: Tokenizer, request: Request, fields: SamplingFields,
                        index: int, metrics: Metrics, eos_token_ids: list[int],
                        counts_prompt: bool = True) -> AsyncIterator[Delta]:
    """Streams one choice. A token that stops the request (a stop id, or eos) keeps its id but, as in vLLM,
    not its text unless include_stop_str_in_output; counts_prompt is False for a prompt's later choices."""
    choice = _Choice(request, Detokenizer(tokenizer.raw, fields.stop, fields.include_stop_str_in_output,
                                          fields.skip_special_tokens, fields.min_tokens),
                     _silent_stops(request, fields, eos_token_ids))
    try:
        stream = await client.submit(request)
    except Overloaded:  # a 429 before the first byte; after it (a later choice), a stream's error event
        raise overloaded() from None
    of_class = metrics.of(ServiceClass(request.service_class))
    outputs = client.outputs(stream)
    try:
        async for out in outputs:
            now = time.monotonic()
            delta = choice.read(out, index)
            choice.clock(of_class, stream, now, len(delta.token_ids))
            if out.finish == Finish.FAILED:
                if delta.text or delta.token_ids or delta.prompt:
                    yield delta
                choice.finish = Finish.FAILED
                raise engine_failed()
            choice.end(delta, out, counts_prompt)
            if delta.text or delta.token_ids or delta.finish or delta.prompt:
                yield delta
            if delta.finish:
                break
    finally:
        await outputs.aclose()  # cancels the slot's request when the choice ended early
        choice.record(metrics, stream, index, counts_prompt)


def _silent_stops(request: Request, fields: SamplingFields, eos_token_ids: list[int]) -> set[int]:
    """The tokens that end the choice without their text: its stop ids and eos, unless include_stop_str_in_output."""
    if fields.include_stop_str_in_output:
        return set()
    return set(request.stop_token_ids) | (set() if request.ignore_eos else set(eos_token_ids))


@dataclass
class _Choice:
    """One choice as its outputs arrive: the prompt's scores, the tokens generated, when they came, how it ended."""

    request: Request
    detok: Detokenizer
    silent_stops: set[int]
    prompt: list[TokenLogprob] = field(default_factory=list)
    prompt_left: int = field(init=False)  # the prompt's scored tokens still to come
    generated: int = 0
    first_at: float | None = None
    last_at: float | None = None
    stats: RequestStats | None = None
    finish: Finish = Finish.ABORT  # stays ABORT if the consumer leaves first

    def __post_init__(self) -> None:
        # The engine publishes the prompt's tokens after the first, scored, ahead of the generated ones.
        self.prompt_left = len(self.request.prompt) - 1 if self.request.prompt_logprobs >= 0 else 0

    def read(self, out: Output, index: int) -> Delta:
        """One output's tokens as a delta: the prompt's scores first, then generated text up to a stop."""
        delta = Delta(index)
        for i, token in enumerate(out.tokens):
            if self.prompt_left:
                self._score_prompt(out, i, token, delta)
            elif self._generate(out, i, token, delta):
                break
        self.stats = out.stats or self.stats
        return delta

    def _score_prompt(self, out: Output, i: int, token: int, delta: Delta) -> None:
        """A prompt token's score; the delta carries them all, with the last one."""
        k = self.request.prompt_logprobs
        top = zip(out.top_ids[i][:k], out.top_logprobs[i][:k], strict=True)
        self.prompt.append(TokenLogprob(token, out.logprobs[i], list(top)))
        self.prompt_left -= 1
        if not self.prompt_left:
            delta.prompt = self.prompt

    def _generate(self, out: Output, i: int, token: int, delta: Delta) -> bool:
        """A generated token into the delta; True when it stops the choice."""
        self.generated += 1
        delta.token_ids.append(token)
        if (k := self.request.logprobs) >= 0:
            top = list(zip(out.top_ids[i][:k], out.top_logprobs[i][:k], strict=True))
            delta.logprobs.append(TokenLogprob(token, out.logprobs[i], top))
        # The engine ends a request on the token that stops it, so it is the last one, even when its finish comes
        # in a later read (the engine publishes the token, then the finish).
        if token in self.silent_stops:
            return True
        piece = self.detok.push(token)
        delta.text += piece.text
        if piece.stopped:
            delta.finish = Finish.STOP
            return True
        return False

    def clock(self, of_class: ClassMetrics, stream: Stream, now: float, tokens: int) -> None:
        """TTFT at the first delta with tokens, then the inter-token latency of each later one."""
        if not tokens:
            return
        if self.first_at is None:
            self.first_at = now
            of_class.ttft.observe(now - stream.submitted_at)
        elif self.last_at is not None:
            of_class.itl.observe((now - self.last_at) / tokens)
        self.last_at = now

    def end(self, delta: Delta, out: Output, counts_prompt: bool) -> None:
        """When the engine finished the request: the text the detokenizer held back, and how it ended."""
        if delta.finish == Finish.NONE and out.finish != Finish.NONE:
            tail = self.detok.flush()
            delta.text += tail.text
            delta.finish = Finish.STOP if tail.stopped else out.finish
        if out.stats is not None and counts_prompt:
            delta.cached_tokens = out.stats.cached_tokens
        self.finish = delta.finish or self.finish

    def record(self, metrics: Metrics, stream: Stream, index: int, counts_prompt: bool) -> None:
        """The finished choice into the metrics and the log, however it ended."""
        request, first_at, generated = self.request, self.first_at, self.generated
        metrics.finished(stream, ChoiceRecord(
            ServiceClass(request.service_class), generated, len(request.prompt) if counts_prompt else 0,
            ttft_s=None if first_at is None else first_at - stream.submitted_at,
            tpot_s=(self.last_at - first_at) / (generated - 1) if first_at is not None and generated > 1 else None,
            ttft_slo_ms=_finite(request.ttft_slo_ms), tpot_slo_ms=_finite(request.tpot_slo_ms),
            outcome=self.finish, stats=self.stats))
        log.info("choice finished", choice=index, slot=stream.slot, prompt_tokens=len(request.prompt),
                 generated=generated, finish_reason=self.finish.name.lower(),
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
