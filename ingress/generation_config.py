"""A checkpoint's sampling defaults (its generation_config.json), as vLLM's `--generation-config` applies them: the
values of the fields a request omits; what a request gives always wins.

`auto` (the default) reads the checkpoint's file, `vllm` ignores it, anything else names a directory holding one.
The file's temperature, top_p, top_k, min_p and repetition_penalty become the knobs' defaults, and its
max_new_tokens caps the tokens of a request that names no max_tokens (else the context's room).
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict, ValidationError

from blink.ingress.protocol import SamplingFields
from blink.shared.request_schema import SamplingKnobs

log = structlog.get_logger()
FILE = "generation_config.json"
KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# vLLM reads the file's differences from transformers' defaults, so a top_k of 50 (transformers' own) is not one.
TRANSFORMERS_DEFAULTS = {"top_k": 50}


class SamplingDefaults(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    knobs: dict[str, float | int] = {}
    max_tokens: int | None = None

    @classmethod
    def read(cls, setting: str, checkpoint_dirs: list[Path]) -> SamplingDefaults:
        """setting: --generation-config; checkpoint_dirs: where `auto` looks, first found first (the tokenizer's
        directory, then the engine's model directory when this host has it). A ValueError says what is wrong."""
        if setting == "vllm":
            return cls()
        if setting == "auto":
            path = next((d / FILE for d in checkpoint_dirs if (d / FILE).is_file()), None)
            if path is None:
                return cls()
        else:
            path = Path(setting) / FILE if Path(setting).is_dir() else Path(setting)
            if not path.is_file():
                raise ValueError(f"--generation-config {setting[:200]!r}: no {FILE} there")
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not readable as JSON ({e})") from None
        defaults = cls.of(config if isinstance(config, dict) else {}, str(path))
        if defaults != cls():
            log.info("sampling defaults from the generation config", path=str(path), **defaults.knobs,
                     max_tokens=defaults.max_tokens)
        return defaults

    @classmethod
    def of(cls, config: dict, source: str = FILE) -> SamplingDefaults:
        """The defaults a generation config gives; a value outside a knob's limits is skipped, with a warning."""
        knobs = {}
        for name in KNOBS:
            value = config.get(name)
            if value is None or isinstance(value, bool) or TRANSFORMERS_DEFAULTS.get(name) == value:
                continue
            if isinstance(SamplingKnobs.model_fields[name].default, float) and isinstance(value, int):
                value = float(value)  # a float knob written as an integer (1 for 1.0)
            try:  # the edge's own types and limits
                knobs[name] = getattr(SamplingKnobs.model_validate({name: value}), name)
            except ValidationError:
                log.warning("generation config value skipped: outside the knob's limits", path=source, knob=name,
                            value=str(value)[:40])
        max_new = config.get("max_new_tokens")
        max_tokens = max_new if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new > 0 else None
        return cls(knobs=knobs, max_tokens=max_tokens)

    def fill(self, fields: SamplingFields) -> SamplingFields:
        """The request with these defaults for the knobs it did not give."""
        missing = {k: v for k, v in self.knobs.items() if k not in fields.model_fields_set}
        return fields.model_copy(update=missing) if missing else fields

    def max_tokens_within(self, room: int) -> int:
        """The tokens a request that names no max_tokens may generate: max_new_tokens within the context's room."""
        return room if self.max_tokens is None else min(room, self.max_tokens)
