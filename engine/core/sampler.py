"""Sampling for the rows of a step: logit biases, penalties, temperature, min-p, top-k, top-p, seeded Gumbel-max.

Randomness comes from a counter-based hash of (seed, index of the token being generated, vocab id),
so a seeded request draws the same noise whatever else is in the batch and however it was scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blink.shared.request_schema import MAX_LOGPROBS

_MASK32 = 0xFFFFFFFF
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (as vLLM), so logits never overflow


@dataclass(frozen=True)
class SamplerFeatures:
    """What the resident requests ask of the sampler; the host knows it, so skipping work costs no sync."""

    penalties: bool = False
    filtering: bool = False  # top-k, top-p or min-p
    random: bool = False  # some temperature > 0
    logprobs: bool = False
    min_tokens: bool = False  # some request holds its stops back for its first tokens
    prompt_logprobs: bool = False  # some request asked for its prompt's logprobs (the step scores them)
    logit_bias: bool = False  # some request biases tokens (OpenAI's logit_bias)


@dataclass
class SamplingRows:
    """Per-row sampling parameters, [R] each."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seed: torch.Tensor
    step_index: torch.Tensor  # how many tokens the row's request has generated so far
    held: torch.Tensor | None = None  # [R, K] token ids the row may not sample yet (-1: none), for min_tokens
    bias_ids: torch.Tensor | None = None  # [R, MAX_LOGIT_BIAS] token ids the row biases (-1: none)
    bias: torch.Tensor | None = None  # [R, MAX_LOGIT_BIAS] what it adds to their logits


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [R] int64
    logprob: torch.Tensor | None  # [R] raw logprob of the sampled token
    top_ids: torch.Tensor | None  # [R, MAX_LOGPROBS]
    top_logprobs: torch.Tensor | None


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x < 2**32 without overflowing int64.
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values below 2**32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of 32-bit words held in int32 (torch's >> on int32 copies the sign bit)."""
    return (x >> k) & ((1 << (32 - k)) - 1)


_MUL2_I32 = 0x846CA68B - (1 << 32)  # lowbias32's second multiplier, as the int32 with its bits


def hash32_words(x: torch.Tensor) -> torch.Tensor:
    """hash32 on int32 tensors holding 32-bit words: the same bits, in a quarter of hash32's passes and half its
    bytes (int32 multiplication wraps modulo 2**32, which is the arithmetic lowbias32 wants)."""
    x = x ^ _shr(x, 16)
    x = x * 0x7FEB352D
    x = x ^ _shr(x, 15)
    x = x * _MUL2_I32  # a Python scalar, not a tensor: no host-to-device copy inside a captured step
    return x ^ _shr(x, 16)


def uniform_noise(seed: torch.Tensor, step_index: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 of shape [R, V], a pure function of (seed, step_index, vocab id). The [R, V] part
    runs on 32-bit words (vocab_hash: hash32 of the ids, either dtype)."""
    key = hash32(seed & _MASK32) ^ hash32(((seed >> 32) & _MASK32) ^ 0x9E3779B9)
    key = hash32(hash32(key) ^ (step_index & _MASK32))
    return bits_to_uniform(hash32_words(key.to(torch.int32)[:, None] ^ vocab_hash.to(torch.int32)[None, :]))


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 below 2**32, or int32 words) to float32 in (0, 1); 23 of them, so the largest value
    stays below 1 in float32."""
    return (_shr(bits, 9).float() + 0.5) * (1.0 / (1 << 23))


def apply_penalties(logits: torch.Tensor, rows: SamplingRows, seen: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """vLLM's semantics: repetition over prompt and output tokens, presence/frequency over output only.

    seen: [R, L] the ids of each row's tokens so far, prompt and output (-1: none), repeats allowed; counts: [R, L]
    how often each was generated. Only those ids change, so the work grows with the context, not the vocabulary:
    each is rewritten from its own logit, count and the row's penalties (a repeated id writes the same value)."""
    vocab = logits.shape[1]
    at = seen.clamp(min=0)
    x = logits.gather(1, at)
    rep = rows.repetition_penalty[:, None]
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - rows.frequency_penalty[:, None] * counts.to(logits.dtype)
    x = x - rows.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    padded = F.pad(logits, (0, 1))  # a last column takes the writes of the rows' unused entries
    return padded.scatter_(1, torch.where(seen >= 0, at, vocab), x)[:, :vocab]


def hold_back(logits: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """min_tokens: the ids in `held` (-1: none) may not be sampled yet."""
    hits = torch.zeros_like(logits, dtype=torch.int32).scatter_add_(1, held.clamp(min=0), (held >= 0).int())
    return logits.masked_fill(hits > 0, float("-inf"))


def filter_logits(scaled: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """min-p, then top-k, then top-p over what top-k kept; filtered-out entries become -inf."""
    vocab = scaled.shape[-1]
    probs = scaled.softmax(-1)
    scaled = scaled.masked_fill(probs < rows.min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    ordered, order = scaled.sort(dim=-1, descending=True)
    k = torch.where(rows.top_k > 0, rows.top_k, vocab)
    ordered = ordered.masked_fill(torch.arange(vocab, device=scaled.device)[None, :] >= k[:, None], float("-inf"))
    p = ordered.softmax(-1)
    # top_p = 1 keeps everything (the float cumsum can reach 1 before the tail).
    beyond_p = (p.cumsum(-1) - p >= rows.top_p[:, None]) & (rows.top_p < 1)[:, None]
    ordered = ordered.masked_fill(beyond_p, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, ordered)


def sample(
    logits: torch.Tensor,
    rows: SamplingRows,
    features: SamplerFeatures,
    vocab_hash: torch.Tensor,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> SampleOutput:
    """logits: float32 [R, V]. Rows with temperature 0 are greedy. seen, counts: the penalties' (apply_penalties)."""
    raw = logits
    if features.logit_bias:
        logits = logits.scatter_add(1, rows.bias_ids.clamp(min=0), torch.where(rows.bias_ids >= 0, rows.bias, 0.0))
    if features.penalties:
        logits = apply_penalties(logits, rows, seen, counts)
    if features.min_tokens:
        logits = hold_back(logits, rows.held)
    tokens = logits.argmax(-1)
    if features.random:
        greedy = rows.temperature < GREEDY_BELOW
        scaled = logits / torch.where(greedy, 1.0, rows.temperature)[:, None]
        if features.filtering:
            scaled = filter_logits(scaled, rows)
        noise = uniform_noise(rows.seed, rows.step_index, vocab_hash)
        drawn = (scaled - torch.log(-torch.log(noise))).argmax(-1)
        tokens = torch.where(greedy, tokens, drawn)
    if not features.logprobs:
        return SampleOutput(tokens, None, None, None)
    logprobs = raw.log_softmax(-1)
    top_logprobs, top_ids = logprobs.topk(min(MAX_LOGPROBS, logprobs.shape[-1]), dim=-1)
    return SampleOutput(tokens, logprobs.gather(1, tokens[:, None])[:, 0], top_ids, top_logprobs)
