"""What a serving benchmark sends: prompts with their token lengths and the output length each asks for.

The datasets, by vLLM's `--dataset-name`:
- `sharegpt`: a ShareGPT-format JSON file (each conversation's first turn is the prompt, the second its reference
  completion, whose length becomes the request's output length);
- `synthetic` (Blink's default): lengths drawn from log-normal distributions matched to ShareGPT's published means
  (161 prompt and 338 output tokens, the vLLM paper) and filtered as vLLM's benchmark filters ShareGPT, with prompts
  made of random vocabulary tokens;
- `random`: vLLM's, lengths uniform within `range_ratio` of the asked ones, after a shared prefix;
- `prefix_repetition`: vLLM's, a few random prefixes each shared by many requests, then a random suffix each (what
  a prefix cache serves).
The random ones carry their token ids: a completions request sends them, so the server sees exactly the lengths
drawn (text re-encoded in context can land a token or two off, and a server adds BOS).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from blink.shared.checkpoints import default_model
from blink.shared.checkpoints.source import resolve
from blink.shared.model_cache import TINY_MODEL_NAME, tiny_model_dir

SHAREGPT_MEAN_PROMPT, SHAREGPT_MEAN_OUTPUT = 161.0, 338.0
PROMPT_SIGMA, OUTPUT_SIGMA = 1.1, 0.9  # log-space spread: long tails, as ShareGPT has
MIN_LEN = 4  # vLLM drops ShareGPT pairs shorter than this on either side


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int
    service_class: str | None = None  # None: the request names no class and the server's default applies
    prompt_ids: list[int] | None = None  # the prompt as tokens, where the dataset drew tokens
    structured: dict | None = None  # vLLM's structured_outputs the request asks with (bench/serving/structured.py)


@dataclass(frozen=True)
class LengthLimits:
    max_prompt_len: int = 1024
    max_total_len: int = 2048

    def admit(self, prompt_len: int, output_len: int, min_output_len: int = MIN_LEN) -> bool:
        return (prompt_len >= MIN_LEN and output_len >= min_output_len and prompt_len <= self.max_prompt_len
                and prompt_len + output_len <= self.max_total_len)


def load_tokenizer(path: str | None, served_model: str) -> Tokenizer:
    """`path` is a tokenizer.json or a checkpoint directory; without one, the served model's own directory when
    it names one, the tiny model's or the default model's when that is what is served."""
    candidates = [Path(path)] if path else [Path(served_model)]
    if not path and served_model == TINY_MODEL_NAME:
        candidates.append(tiny_model_dir())
    if not path and served_model == default_model.NAME:
        candidates.append(resolve(None, weights=False).path)
    for candidate in candidates:
        file = candidate / "tokenizer.json" if candidate.is_dir() else candidate
        if file.is_file():
            return Tokenizer.from_file(str(file))
    raise SystemExit(f"no tokenizer for {served_model!r}: pass --tokenizer (a tokenizer.json or checkpoint dir)")


def sharegpt(path: Path, tokenizer: Tokenizer, num: int, limits: LengthLimits, seed: int,
             output_len: int | None = None) -> list[SampleRequest]:
    try:
        conversations = [[turn["value"] for turn in c["conversations"][:2]] for c in json.loads(Path(path).read_text())
                         if len(c.get("conversations") or []) >= 2]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise SystemExit(f"{path}: not a ShareGPT file (a list of {{\"conversations\": [{{\"value\": ...}}]}}): "
                         f"{type(e).__name__}: {e}") from None
    random.Random(seed).shuffle(conversations)
    samples = []
    for prompt, reference in conversations:
        if not isinstance(prompt, str) or not isinstance(reference, str):
            continue
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
        wanted = output_len or len(tokenizer.encode(reference, add_special_tokens=False).ids)
        if limits.admit(prompt_len, wanted, 1 if output_len else MIN_LEN):
            samples.append(SampleRequest(prompt, prompt_len, wanted))
            if len(samples) == num:
                return samples
    raise SystemExit(f"{path}: only {len(samples)} of {len(conversations)} conversations fit the length limits, "
                     f"{num} wanted")


def synthetic(tokenizer: Tokenizer, num: int, limits: LengthLimits, seed: int, input_len: int | None = None,
              output_len: int | None = None) -> list[SampleRequest]:
    rng = random.Random(seed)
    vocab = _plain_vocab(tokenizer)
    min_output = 1 if output_len else MIN_LEN  # a fixed output length is the user's choice, even 1 (TTFT only)
    if not limits.admit(input_len or MIN_LEN, output_len or MIN_LEN, min_output):
        raise SystemExit(f"--input-len {input_len} / --output-len {output_len} cannot fit {limits} (prompts need "
                         f"at least {MIN_LEN} tokens)")
    samples = []
    for _ in range(1000 * num):
        prompt_len = input_len or _lognormal(rng, SHAREGPT_MEAN_PROMPT, PROMPT_SIGMA)
        wanted = output_len or _lognormal(rng, SHAREGPT_MEAN_OUTPUT, OUTPUT_SIGMA)
        if limits.admit(prompt_len, wanted, min_output):
            prompt = random_text(tokenizer, vocab, prompt_len, rng)
            actual = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
            if limits.admit(actual, wanted, min_output):  # re-encoding can land a token or two off the length drawn
                samples.append(SampleRequest(prompt, actual, wanted))
                if len(samples) == num:
                    return samples
    raise SystemExit(f"could draw only {len(samples)} of {num} requests within {limits}")


def _plain_vocab(tokenizer: Tokenizer) -> list[int]:
    special = set(tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.get_vocab_size()) if i not in special]


def random_tokens(tokenizer: Tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                  prefix_len: int = 0) -> list[SampleRequest]:
    """vLLM's `random` dataset: input and output lengths uniform in [len * (1 - r), len * (1 + r)], each prompt
    after one shared random prefix of prefix_len tokens."""
    if not 0 <= range_ratio < 1:
        raise SystemExit("--random-range-ratio must be in [0, 1)")
    rng, vocab = random.Random(seed), _plain_vocab(tokenizer)
    prefix = rng.choices(vocab, k=prefix_len)

    def length(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - range_ratio)), math.ceil(n * (1 + range_ratio))))

    return [_sample(tokenizer, prefix + rng.choices(vocab, k=length(input_len)), length(output_len))
            for _ in range(num)]


def prefix_repetition(tokenizer: Tokenizer, num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                      output_len: int, seed: int) -> list[SampleRequest]:
    """vLLM's `prefix_repetition` dataset: num_prefixes random prefixes, each shared by num / num_prefixes
    requests (in a shuffled order), each followed by a random suffix of its own."""
    rng, vocab = random.Random(seed), _plain_vocab(tokenizer)
    prefixes = [rng.choices(vocab, k=prefix_len) for _ in range(num_prefixes)]
    samples = [_sample(tokenizer, prefixes[i % num_prefixes] + rng.choices(vocab, k=suffix_len), output_len)
               for i in range(num)]
    rng.shuffle(samples)
    return samples


def _sample(tokenizer: Tokenizer, ids: list[int], output_len: int) -> SampleRequest:
    return SampleRequest(tokenizer.decode(ids), len(ids), output_len, prompt_ids=ids)


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
