"""What a serving benchmark sends: prompts with their token lengths and the output length each asks for.

From a ShareGPT-format JSON file (each conversation's first turn is the prompt, the second its reference
completion, whose length becomes the request's output length), or synthetic: lengths drawn from log-normal
distributions matched to ShareGPT's published means (161 prompt and 338 output tokens, the vLLM paper) and
filtered as vLLM's benchmark filters ShareGPT, with prompts made of random vocabulary tokens.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from blink.shared.model_cache import DEFAULT_MODEL_NAME, default_model_dir

SHAREGPT_MEAN_PROMPT, SHAREGPT_MEAN_OUTPUT = 161.0, 338.0
PROMPT_SIGMA, OUTPUT_SIGMA = 1.1, 0.9  # log-space spread: long tails, as ShareGPT has
MIN_LEN = 4  # vLLM drops ShareGPT pairs shorter than this on either side


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class LengthLimits:
    max_prompt_len: int = 1024
    max_total_len: int = 2048

    def admit(self, prompt_len: int, output_len: int) -> bool:
        return (prompt_len >= MIN_LEN and output_len >= MIN_LEN and prompt_len <= self.max_prompt_len
                and prompt_len + output_len <= self.max_total_len)


def load_tokenizer(path: str | None, served_model: str) -> Tokenizer:
    """`path` is a tokenizer.json or a checkpoint directory; without one, the served model's own directory when
    it names one, or the default model's when that is what is served."""
    candidates = [Path(path)] if path else [Path(served_model)]
    if not path and served_model == DEFAULT_MODEL_NAME:
        candidates.append(default_model_dir())
    for candidate in candidates:
        file = candidate / "tokenizer.json" if candidate.is_dir() else candidate
        if file.is_file():
            return Tokenizer.from_file(str(file))
    raise SystemExit(f"no tokenizer for {served_model!r}: pass --tokenizer (a tokenizer.json or checkpoint dir)")


def sharegpt(path: Path, tokenizer: Tokenizer, num: int, limits: LengthLimits, seed: int,
             output_len: int | None = None) -> list[SampleRequest]:
    conversations = [c["conversations"] for c in json.loads(Path(path).read_text())
                     if len(c.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(conversations)
    samples = []
    for turns in conversations:
        prompt = turns[0]["value"]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
        wanted = output_len or len(tokenizer.encode(turns[1]["value"], add_special_tokens=False).ids)
        if limits.admit(prompt_len, wanted):
            samples.append(SampleRequest(prompt, prompt_len, wanted))
            if len(samples) == num:
                return samples
    raise SystemExit(f"{path}: only {len(samples)} of {len(conversations)} conversations fit the length limits, "
                     f"{num} wanted")


def synthetic(tokenizer: Tokenizer, num: int, limits: LengthLimits, seed: int, input_len: int | None = None,
              output_len: int | None = None) -> list[SampleRequest]:
    rng = random.Random(seed)
    special = set(tokenizer.get_added_tokens_decoder())
    vocab = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    if input_len is not None and output_len is not None and not limits.admit(input_len, output_len):
        raise SystemExit(f"--input-len {input_len} and --output-len {output_len} exceed the length limits {limits}")
    samples = []
    while len(samples) < num:
        prompt_len = input_len or _lognormal(rng, SHAREGPT_MEAN_PROMPT, PROMPT_SIGMA)
        wanted = output_len or _lognormal(rng, SHAREGPT_MEAN_OUTPUT, OUTPUT_SIGMA)
        if limits.admit(prompt_len, wanted):
            prompt = random_text(tokenizer, vocab, prompt_len, rng)
            actual = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
            if limits.admit(actual, wanted):  # re-encoding can land a token or two off the length drawn
                samples.append(SampleRequest(prompt, actual, wanted))
    return samples


def random_text(tokenizer: Tokenizer, vocab: list[int], length: int, rng: random.Random) -> str:
    """Text of about `length` tokens: random tokens decoded, then re-encoded and cut, since decoding can merge
    neighbours into fewer tokens or split them into more."""
    ids = rng.choices(vocab, k=length)
    for _ in range(4):
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False).ids
        if len(ids) == length:
            break
        ids = ids[:length] + rng.choices(vocab, k=max(0, length - len(ids)))
    return tokenizer.decode(ids)


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))
