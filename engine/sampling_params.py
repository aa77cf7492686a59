"""SamplingParams: vLLM's field names, validated at the edge of the offline API."""

from __future__ import annotations

from pydantic import ConfigDict, Field, StrictInt, field_validator

from blink.shared.request_schema import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_IDS, SamplingKnobs, logit_bias_pairs
from blink.shared.service_class import ServiceClass


class SamplingParams(SamplingKnobs):
    """How to sample one request. Invalid values raise a ValueError that names the field. The knobs (temperature,
    top_p, top_k, min_p, the penalties, ignore_eos, priority) and their limits are blink.shared.request_schema's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: StrictInt | None = Field(16, ge=1)
    stop_token_ids: list[StrictInt] = Field(default_factory=list, max_length=MAX_STOP_IDS)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: per prompt token, top k
    logit_bias: dict[int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)  # token id -> bias in [-100, 100]
    service_class: ServiceClass = ServiceClass.LATENCY_SENSITIVE
    ttft_slo_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    tpot_slo_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        logit_bias_pairs(v)
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v
