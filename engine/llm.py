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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length | abort
    logprobs: list[dict[int, float]] | None = None  # per generated token: its logprob and the top ones
    # vLLM's: per prompt token, its logprob given those before it and the top ones (None for the first)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int | None = None  # vLLM's: prompt tokens whose KV the prefix cache held (with the finish)


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
        outputs: dict[str, RequestOutput] = {}
        for out, params, max_tokens in requests:
            outputs[out.request_id] = out
            if params.logprobs is not None:
                out.logprobs = []
            if params.prompt_logprobs is not None:
                out.prompt_logprobs = [None]
            self._driver.add_request(out.request_id, out.prompt_token_ids, params, max_tokens)
        while self._driver.has_work():
            for event in self._driver.step():
                out = outputs.get(event.request_id)
                if out is None:
                    continue  # an aborted leftover
                if out.prompt_logprobs is not None:
                    out.prompt_logprobs += [{**dict(p.top), p.token_id: p.logprob} for p in event.prompt]
                for sampled in event.tokens:
                    out.token_ids.append(sampled.token)
                    if out.logprobs is not None:
                        out.logprobs.append(sampled.top_logprobs)
                out.finish_reason = event.finish_reason or out.finish_reason
                if event.stats is not None:
                    out.num_cached_tokens = event.stats.cached_tokens
        for out in outputs.values():
            out.text = self.tokenizer.decode(out.token_ids)
        return list(outputs.values())

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
