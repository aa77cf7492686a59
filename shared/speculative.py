"""`--speculative-config`: speculative decoding's settings, in vLLM's shape (a JSON object), checked once here for
the flag, the environment variable and the offline API's `LLM(speculative_config={...})` alike (no torch: the
settings import it)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from blink.shared.quantization import QUANTIZATIONS

METHODS = ("ngram", "draft_model")  # vLLM's names; EAGLE heads are not built yet
MAX_SPECULATIVE_TOKENS = 16  # a slot's rows in a step: 1 + this many
MAX_LOOKUP = 16  # the longest n-gram looked up
DEFAULT_LOOKUP = 5  # vLLM's, for an unset prompt_lookup_min and max
HELP = ("speculative decoding as vLLM's flag, a JSON object: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}': drafts looked up in each request's own tokens; or "
        "'{\"model\": \"DRAFT\", \"num_speculative_tokens\": 4}': a smaller model of the same tokenizer drafts "
        "greedily; verified in the step, greedy and seeded outputs unchanged (unset: off)")


class SpeculativeConfig(BaseModel):
    """ngram (prompt lookup): the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) found earlier in
    the request's prompt and output; the num_speculative_tokens tokens that followed are the draft. draft_model: a
    smaller model of the same tokenizer (`model`, named as --model names one) drafts them greedily in the step. As in
    vLLM, a config with a model and no method is a draft model's."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    method: Literal[METHODS] = "ngram"
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)
    # vLLM's defaults: both unset, 5; one unset, the other's value.
    prompt_lookup_min: int | None = Field(None, ge=1, le=MAX_LOOKUP)
    prompt_lookup_max: int | None = Field(None, ge=1, le=MAX_LOOKUP)
    # The draft model's (draft_model): a checkpoint directory, a .gguf file or a Hub id; its revision; and its own
    # --quantization.
    model: str | None = Field(None, min_length=1)
    revision: str | None = None
    quantization: Literal[QUANTIZATIONS] | None = None

    @model_validator(mode="before")
    @classmethod
    def _method(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("method") is None and data.get("model") is not None:
            if data["model"] in ("ngram", "[ngram]"):  # vLLM's older spelling of the method
                return {**{k: v for k, v in data.items() if k != "model"}, "method": "ngram"}
            data = {**data, "method": "draft_model"}
        return data

    @model_validator(mode="after")
    def _range(self) -> SpeculativeConfig:
        if self.method == "draft_model":
            if self.model is None:
                raise ValueError("method draft_model needs the draft's \"model\"")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("prompt_lookup_min and prompt_lookup_max are ngram's: a draft model looks nothing up")
            return self
        if self.model is not None or self.revision is not None or self.quantization is not None:
            raise ValueError("model, revision and quantization name a draft model: method ngram has none "
                             "(method draft_model, or leave method out)")
        if self.lookup_max < self.lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least prompt_lookup_min "
                             f"({self.prompt_lookup_min})")
        return self

    @property
    def lookup_min(self) -> int:
        return next((n for n in (self.prompt_lookup_min, self.prompt_lookup_max) if n is not None), DEFAULT_LOOKUP)

    @property
    def lookup_max(self) -> int:
        return next((n for n in (self.prompt_lookup_max, self.prompt_lookup_min) if n is not None), DEFAULT_LOOKUP)


def speculative_config(value: object) -> SpeculativeConfig | None:
    """The config from a JSON string, a dict or a config (None, '' or {}: off); ValueError naming the flag."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"speculative_config must be a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    if not value:
        return None
    try:
        return SpeculativeConfig(**value)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"speculative_config: {problems}") from None
