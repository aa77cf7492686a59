"""SamplingParams: vLLM's field names, validated at the edge."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from blink.shared.service_class import ServiceClass

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 16


class SamplingParams(BaseModel):
    """How to sample one request. Invalid values raise a ValueError that names the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = 0
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: StrictInt | None = Field(16, ge=1)
    stop_token_ids: list[StrictInt] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    seed: StrictInt | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    priority: StrictInt = Field(0, ge=-(2**15), lt=2**15)
    service_class: ServiceClass = ServiceClass.LATENCY_SENSITIVE
    ttft_slo_ms: float | None = Field(None, gt=0.0)
    tpot_slo_ms: float | None = Field(None, gt=0.0)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("top_k must be -1 or 0 (disabled) or a positive integer")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        return v

    @model_validator(mode="after")
    def _not_nan(self) -> SamplingParams:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if value != value:  # NaN passes ge/le checks
                raise ValueError(f"{name} must be a number, not NaN")
        return self
