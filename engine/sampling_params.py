"""SamplingParams: vLLM's field names, validated at the edge of the offline API."""

from __future__ import annotations

from pydantic import ConfigDict, Field, StrictFloat, StrictInt, field_validator, model_validator

from blink.shared.grammar import StructuredOutputs, check_combination
from blink.shared.request_schema import MAX_LOGIT_BIAS, MAX_LOGPROBS, EdgeFields, logit_bias_pairs
from blink.shared.service_class import ServiceClass


class SamplingParams(EdgeFields):
    """How to sample one request. Invalid values raise a ValueError that names the field. The knobs (temperature,
    top_p, top_k, min_p, the penalties, ignore_eos, priority), stop_token_ids, seed, prompt_logprobs and the SLOs, and
    their limits, are blink.shared.request_schema's, as the OpenAI API's are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[int, StrictFloat] | None = Field(None, max_length=MAX_LOGIT_BIAS)  # token id -> [-100, 100]
    service_class: ServiceClass = ServiceClass.LATENCY_SENSITIVE
    structured_outputs: StructuredOutputs | None = None  # vLLM's: the output follows a JSON schema, regex, ...

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        logit_bias_pairs(v)
        return v

    @model_validator(mode="after")
    def _grammar(self) -> SamplingParams:
        if self.structured_outputs is not None:
            self.structured_outputs.spec()  # a GrammarError (a ValueError) for a schema that cannot be one
            check_combination(self.ignore_eos, self.min_tokens)
        return self
