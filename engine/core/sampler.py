"""Sampling for the rows of a step: logit biases, penalties, temperature, min-p, top-k, top-p, seeded Gumbel-max.

Randomness comes from a counter-based hash of (seed, index of the token being generated, vocab id),
so a seeded request draws the same noise whatever else is in the batch and however it was scheduled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

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


def features_asked(fields: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each request asks of the sampler, from its fields ([N] each, named as in blink.shared.request_schema):
    for each feature of SamplerFeatures, an [N] bool."""
    return {
        "penalties": (fields["repetition_penalty"] != 1) | (fields["presence_penalty"] != 0)
        | (fields["frequency_penalty"] != 0),
        "filtering": (fields["top_k"] > 0) | (fields["top_p"] < 1) | (fields["min_p"] > 0),
        "random": fields["temperature"] >= GREEDY_BELOW,
        "logprobs": fields["logprobs"] >= 0,
        "min_tokens": fields["min_tokens"] > 0,
        "prompt_logprobs": fields["prompt_logprobs"] >= 0,
        "logit_bias": fields["num_logit_bias"] > 0,
    }


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
    logprobs: torch.Tensor | None = None  # [R] top logprobs the row's request asked for (-1: none)


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [R] int64
    logprob: torch.Tensor | None  # [R] raw logprob of the sampled token
    top_ids: torch.Tensor | None  # [R, MAX_LOGPROBS]
    top_logprobs: torch.Tensor | None
    passes: torch.Tensor | None = None  # [R] passes over the logits each row took (the fused kernel counts them)


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


def noise_key(seed: torch.Tensor, step_index: torch.Tensor) -> torch.Tensor:
    """[R] int32 words: each row's key for this token, from its seed and how many tokens it has generated."""
    key = hash32(seed & _MASK32) ^ hash32(((seed >> 32) & _MASK32) ^ 0x9E3779B9)
    return hash32(hash32(key) ^ (step_index & _MASK32)).to(torch.int32)


def uniform_noise(seed: torch.Tensor, step_index: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 of shape [R, V], a pure function of (seed, step_index, vocab id). The [R, V] part
    runs on 32-bit words (vocab_hash: hash32 of the ids, either dtype)."""
    key = noise_key(seed, step_index)
    return bits_to_uniform(hash32_words(key[:, None] ^ vocab_hash.to(torch.int32)[None, :]))


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 below 2**32, or int32 words) to float32 in (0, 1); 23 of them, so the largest value
    stays below 1 in float32."""
    return (_shr(bits, 9).float() + 0.5) * (1.0 / (1 << 23))


def apply_penalties(logits: torch.Tensor, rows: SamplingRows, seen: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """vLLM's semantics, in place: repetition over prompt and output tokens, presence/frequency over output only.

    seen: [R, L] the ids of each row's tokens so far, prompt and output (-1: none), repeats allowed; counts: [R, L]
    how often each was generated. Only those ids change, so the work grows with the context, not the vocabulary:
    each is rewritten from its own logit, count and the row's penalties. An unused entry rewrites the row's first
    id, with that id's value (a repeated id writes the same value, so the scatter's order cannot matter)."""
    used = seen >= 0
    at = torch.where(used, seen, seen[:, :1].clamp(min=0))
    counts = torch.where(used, counts, counts[:, :1]).to(logits.dtype)
    x = logits.gather(1, at)
    rep = rows.repetition_penalty[:, None]
    penalised = torch.where(x > 0, x / rep, x * rep)
    penalised = penalised - rows.frequency_penalty[:, None] * counts - rows.presence_penalty[:, None] * (counts > 0)
    return logits.scatter_(1, at, torch.where(used[:, :1], penalised, x))  # a row with no tokens: unchanged


def hold_back(logits: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """min_tokens, in place: the ids in `held` (-1: none) may not be sampled yet (the minimum with +inf leaves a
    logit alone, so unused entries can share an id with a used one)."""
    return logits.scatter_reduce_(1, held.clamp(min=0), torch.where(held >= 0, float("-inf"), float("inf")), "amin")


def edit_logits(logits: torch.Tensor, rows: SamplingRows, features: SamplerFeatures, seen: torch.Tensor | None,
                counts: torch.Tensor | None) -> torch.Tensor:
    """In place, the sparse edits before sampling, in order: logit biases, penalties, tokens held back. Each touches
    the ids a row names, never the whole vocabulary."""
    if features.logit_bias:
        logits.scatter_add_(1, rows.bias_ids.clamp(min=0), torch.where(rows.bias_ids >= 0, rows.bias, 0.0))
    if features.penalties:
        apply_penalties(logits, rows, seen, counts)
    if features.min_tokens:
        hold_back(logits, rows.held)
    return logits


def edits(rows: SamplingRows, features: SamplerFeatures, seen: torch.Tensor | None) -> list[torch.Tensor]:
    """The ids `edit_logits` may rewrite ([R, n] each; -1 unused), so a caller can save and restore them."""
    return [ids for on, ids in ((features.logit_bias, rows.bias_ids), (features.penalties, seen),
                                (features.min_tokens, rows.held)) if on]


def filtered(scaled: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """What min-p, then top-k, then top-p over what top-k kept leave of each row ([R, V] bool).

    Every filter keeps a set of values, not of positions, so tokens with equal logits stay or go together (vLLM's
    top-k keeps ties too): min-p keeps s with s - max >= log(min_p); top-k keeps s >= the k-th largest kept;
    top-p keeps s when the mass of kept tokens with larger values stays below top_p."""
    vocab = scaled.shape[-1]
    m = scaled.amax(-1, keepdim=True)
    s = scaled.masked_fill(scaled - m < rows.min_p.log()[:, None], float("-inf"))
    ordered = s.sort(dim=-1, descending=True).values
    k = torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), vocab)
    kth = ordered.gather(1, k[:, None] - 1)
    s = s.masked_fill(s < kth, float("-inf"))
    e = (ordered - m).exp().masked_fill(ordered < kth, 0.0)
    # top_p = 1 keeps everything (the float sum can reach the total before the tail).
    beyond = (e.cumsum(-1) - e >= rows.top_p[:, None] * e.sum(-1, keepdim=True)) & (rows.top_p < 1)[:, None]
    # The smallest value kept (beyond is a suffix of the order); the largest stays whatever top_p came in a record.
    last = ((~beyond).sum(-1, keepdim=True) - 1).clamp(min=0)
    return (s > float("-inf")) & (s >= ordered.gather(1, last))


def sample(
    logits: torch.Tensor,
    rows: SamplingRows,
    features: SamplerFeatures,
    vocab_hash: torch.Tensor,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> SampleOutput:
    """The torch sampler: the reference, and the CPU's. logits: float32 [R, V], left as they are. Rows with
    temperature 0 are greedy. seen, counts: the penalties' (apply_penalties)."""
    raw = logits
    if edits(rows, features, seen):
        logits = edit_logits(logits.clone(), rows, features, seen, counts)
    tokens = logits.argmax(-1)
    if features.random:
        greedy = rows.temperature < GREEDY_BELOW
        scaled = logits / torch.where(greedy, 1.0, rows.temperature)[:, None]
        if features.filtering:
            scaled = scaled.masked_fill(~filtered(scaled, rows), float("-inf"))
        noise = uniform_noise(rows.seed, rows.step_index, vocab_hash)
        drawn = (scaled - torch.log(-torch.log(noise))).argmax(-1)
        tokens = torch.where(greedy, tokens, drawn)
    if not features.logprobs:
        return SampleOutput(tokens, None, None, None)
    return SampleOutput(tokens, *token_logprobs(raw, tokens))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   asked: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's logprob of its token ([R]) and its top MAX_LOGPROBS (ids and logprobs, [R, k]): the raw
    log-softmax. asked: which rows need them (-1: not); this reference scores every row."""
    logprobs = logits.log_softmax(-1)
    top_logprobs, top_ids = logprobs.topk(min(MAX_LOGPROBS, logprobs.shape[-1]), dim=-1)
    return logprobs.gather(1, tokens[:, None])[:, 0], top_ids, top_logprobs


@dataclass(frozen=True)
class Sampler:
    """Where the sampling implementations meet: the torch reference (TORCH_SAMPLER, the CPU's) and the fused
    kernels (blink.engine.kernels.step_sampler.FUSED_SAMPLER, the GPU's) take the same arguments and give the same
    tokens."""

    sample: Callable[..., SampleOutput]  # sample's signature
    logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # token_logprobs'
    # The step's sampling read from the slot state by each row's slot (blink.engine.kernels.step_sampler's
    # StepKernels: rows_read, sample), the same tokens; None: the step gathers each row's parameters for `sample`.
    step: Any = None


TORCH_SAMPLER = Sampler(sample, token_logprobs)
