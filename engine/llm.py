"""The offline Python API: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from blink.engine.drive.offline import OfflineDriver
from blink.engine.engine import Engine, EngineConfig
from blink.engine.errors import RequestError
from blink.engine.ranks import Ranks, agreed, free_init_method, replay_generate
from blink.engine.sampling_params import SamplingParams
from blink.shared.grammar import GrammarError

Prompt = str | list[int]


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's logprob, its rank (1: the most likely) where it is one of the top ones the request asked
    for (None for a drawn token outside them: vLLM ranks it over the vocabulary), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """vLLM's: one completion of a request (Blink draws one: `outputs[0]`)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None  # the drawn tokens' logprobs summed, where the request asked for them
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: its logprob and the top ones
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | None = None  # the stop_token_ids entry that ended it (None: eos, the length or an abort)


@dataclass
class RequestOutput:
    """vLLM's shape (`out.outputs[0].text`); `text`, `token_ids`, `finish_reason` and `logprobs` read the one
    completion's, for callers that never ask for more."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # vLLM's: per prompt token, its logprob given those before it and the top ones (None for the first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput()])
    finished: bool = False
    num_cached_tokens: int | None = None  # vLLM's: prompt tokens whose KV the prefix cache held (with the finish)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        """engine_options: EngineConfig's fields; with tensor_parallel_size N > 1 this process is rank 0 and starts
        the other ranks (blink.engine.ranks)."""
        self._ranks = None
        if engine_options.get("tensor_parallel_size", 1) > 1 and "tensor_parallel_rank" not in engine_options:
            engine_options = agreed(model, {"distributed_init_method": free_init_method(), **engine_options})
            self._ranks = Ranks(model, engine_options, replay_generate)
        self.engine = Engine(EngineConfig(model=model, **engine_options),
                             lost_rank=self._ranks.lost if self._ranks else None)
        self.tokenizer = self.engine.tokenizer
        self._driver = OfflineDriver(self.engine)
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")

        # Validate every request before any is queued, so one bad prompt loses nothing.
        requests = [self._prepare(p, sp) for p, sp in zip(prompts, sampling_params, strict=True)]
        if self._ranks is not None:  # the other ranks run the same call, in lock-step with this one
            self._ranks.check()
            self._ranks.send((prompts, sampling_params))
        self._driver.abort_all()  # what an interrupted call left behind
        outputs: dict[str, tuple[RequestOutput, SamplingParams]] = {}
        for out, params, max_tokens in requests:
            outputs[out.request_id] = out, params
            if params.logprobs is not None:
                out.outputs[0].logprobs = []
                out.outputs[0].cumulative_logprob = 0.0
            if params.prompt_logprobs is not None:
                out.prompt_logprobs = [None]
            self._driver.add_request(out.request_id, out.prompt_token_ids, params, max_tokens)
        while self._driver.has_work():
            for event in self._driver.step():
                out, _ = outputs.get(event.request_id, (None, None))
                if out is None:
                    continue  # an aborted leftover
                completion = out.outputs[0]
                if out.prompt_logprobs is not None:
                    out.prompt_logprobs += [self._logprobs(p.token_id, p.logprob, p.top) for p in event.prompt]
                for sampled in event.tokens:
                    completion.token_ids.append(sampled.token)
                    if completion.logprobs is not None:
                        completion.logprobs.append(self._logprobs(sampled.token, sampled.logprob, sampled.top))
                        completion.cumulative_logprob += sampled.logprob or 0.0
                completion.finish_reason = event.finish_reason or completion.finish_reason
                if event.stats is not None:
                    out.num_cached_tokens = event.stats.cached_tokens
        for out, params in outputs.values():
            completion = out.outputs[0]
            completion.text = self.tokenizer.decode(completion.token_ids)
            last = completion.token_ids[-1] if completion.token_ids else None
            if completion.finish_reason == "stop" and last in (params.stop_token_ids or ()):
                completion.stop_reason = last
            out.finished = completion.finish_reason is not None
        return [out for out, _ in outputs.values()]

    def _logprobs(self, token: int, logprob: float | None, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """vLLM's entry for one position: the top tokens ranked in order, then the drawn or scored one."""
        if logprob is None:
            return {}
        entry = {t: Logprob(lp, rank, self.tokenizer.decode([t])) for rank, (t, lp) in enumerate(top, start=1)}
        if token not in entry:
            entry[token] = Logprob(logprob, None, self.tokenizer.decode([token]))
        return entry

    def close(self) -> None:
        """Stops the other ranks, with tensor parallelism (they also end with this process)."""
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None
            import torch.distributed as dist

            dist.destroy_process_group()  # a later LLM's ranks meet anew

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[RequestOutput, SamplingParams, int]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        vocab = self.engine.model_config.vocab_size
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if any(not 0 <= t < vocab for t in params.logit_bias or ()):
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        if params.structured_outputs is not None:  # compiled now (and cached): an invalid schema is the caller's error
            try:
                grammars = self._driver.rank.grammars
                grammars.compiler.compile(params.structured_outputs.spec())
            except GrammarError as e:
                raise RequestError(str(e), param="structured_outputs") from None
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise RequestError(f"the prompt has {len(ids)} tokens, but the context limit is {limit} "
                               "and at least one token must be generated", param="prompt")
        room = limit - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request_id = str(self._next_id)
        self._next_id += 1
        return RequestOutput(request_id, text, ids), params, max_tokens


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
