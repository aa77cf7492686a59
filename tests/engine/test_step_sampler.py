"""The step's sampling kernels (engine/kernels/step_sampler.py) against the torch reference the step runs without
them (engine/core/step.py's gathers, `sample`, `_prompt_tokens` and `score_prompt`), row by row, in Triton's
interpreter without a GPU: the rows read, the tokens (greedy, seeded, filtered), the edits (logit bias, penalties
over the sequence's tokens, min_tokens' held ids), the logprobs and the prompt's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from blink.engine.core.commit import score_prompt
from blink.engine.core.sampler import SamplerFeatures, hash32, sample
from blink.engine.core.state import Slots
from blink.engine.core.step import _prompt_tokens, _seen_tokens, sampling_rows
from blink.engine.kernels.step_sampler import StepKernels
from blink.engine.kernels.tickets import tickets

V, S, MAX_LEN, B = 700, 8, 48, 40
ALL = SamplerFeatures(**dict.fromkeys(SamplerFeatures.__dataclass_fields__, True))
KERNELS = StepKernels(block=256, chunk=256)  # three of each in a row of V
# (temperature, top_p, top_k, min_p) per slot, as the fused sampler's tests mix them.
KINDS = [(0.0, 1.0, 0, 0.0), (1.0, 1.0, 0, 0.0), (0.7, 1.0, 0, 0.05), (1.3, 1.0, 40, 0.0), (1.0, 0.9, 0, 0.0),
         (0.8, 0.7, 100, 0.01), (0.0, 0.5, 7, 0.2), (2.0, 0.05, 0, 0.0)]


def _state(gen: torch.Generator) -> Slots:
    state = Slots(S, MAX_LEN, 8, V, torch.device("cpu"))
    for i, (t, p, k, m) in enumerate(KINDS):
        state.temperature[i], state.top_p[i], state.top_k[i], state.min_p[i] = t, p, k, m
    state.repetition_penalty.copy_(1 + torch.rand(S, generator=gen))
    state.presence_penalty.copy_(torch.rand(S, generator=gen) - 0.5)
    state.frequency_penalty.copy_(torch.rand(S, generator=gen) - 0.5)
    state.repetition_penalty[3], state.presence_penalty[3], state.frequency_penalty[3] = 1.0, 0.0, 0.0  # neutral
    state.seed.copy_(torch.randint(0, 2**62, (S,), generator=gen))
    state.prompt_len.copy_(torch.randint(1, 20, (S,), generator=gen))
    state.seq_len.copy_(state.prompt_len + torch.randint(0, 20, (S,), generator=gen))
    state.seq_len[5] = 0  # a sequence with no tokens: nothing to penalise
    # Few distinct ids, so sequences repeat them (each rewritten once, from its raw value) and overlap the biases.
    state.tokens.copy_(torch.randint(0, 30, (S, MAX_LEN + 1), generator=gen, dtype=torch.int32))
    state.output_counts.copy_(torch.randint(0, 3, (S, V), generator=gen, dtype=torch.int32))
    state.min_tokens.copy_(torch.randint(0, 30, (S,), generator=gen))
    state.ignore_eos[1] = True
    state.stop_ids[:, :3] = torch.randint(0, V, (S, 3), generator=gen)
    state.stop_ids[2, 1] = -1
    state.logit_bias_ids[:, 0] = torch.randint(0, 30, (S,), generator=gen)
    state.logit_bias_ids[:, 5] = torch.randint(0, V, (S,), generator=gen)
    state.logit_bias_ids[4] = -1  # no bias
    state.logit_bias.copy_(torch.randn(state.logit_bias.shape, generator=gen) * 5)
    state.logprobs.copy_(torch.tensor([-1, 5, -1, 0, 20, -1, 3, -1]))
    state.num_computed.copy_(torch.randint(0, 10, (S,), generator=gen))
    state.scored.copy_(torch.randint(0, 12, (S,), generator=gen))
    return state


def _plan(state: Slots, gen: torch.Generator, rows: int) -> SimpleNamespace:
    """A plan's sampling and prompt fields: batch tokens of random slots and positions, the last few padding."""
    token_slot = torch.randint(0, S, (B,), generator=gen).sort().values
    token_pos = state.num_computed[token_slot] + torch.randint(0, 6, (B,), generator=gen)
    token_valid = torch.arange(B) < B - 5
    return SimpleNamespace(
        token_slot=token_slot, token_pos=torch.where(token_valid, token_pos, 0), token_valid=token_valid,
        sample_slot=torch.randperm(S, generator=gen)[:rows], sample_token=torch.randperm(B - 5, generator=gen)[:rows],
        prompt_entries=torch.randint(1, 4, (S,), generator=gen) * (torch.arange(S) % 3 == 0))


def _expected(logits, state, plan, features, eos_ids, rows, prompt_rows):
    read = plan.sample_token[:rows]
    prompt = _prompt_tokens(state, plan, B, prompt_rows) if prompt_rows else None
    sampling = sampling_rows(state, plan, read, features, eos_ids)
    out = sample(logits[:rows], sampling, features, hash32(torch.arange(V)),
                 *(_seen_tokens(state, plan.sample_slot[:rows]) if features.penalties else ()))
    scored = score_prompt(state, plan, prompt, logits[rows:]) if prompt_rows else None
    return (read if prompt is None else torch.cat([read, prompt])), out, scored


@pytest.mark.parametrize("features, seed, rows, prompt_rows", [
    (ALL, 0, S, 10), (ALL, 1, 5, 0), (SamplerFeatures(random=True, filtering=True, penalties=True), 2, S, 0),
    (SamplerFeatures(logit_bias=True, min_tokens=True), 3, 6, 12), (SamplerFeatures(), 4, S, 0), (ALL, 5, 0, 9)],
    ids=["every-feature", "fewer-rows", "filters-penalties", "bias-held-greedy", "greedy", "prompt-rows-only"])
def test_the_step_kernels_sample_as_the_reference(features, seed, rows, prompt_rows):
    gen = torch.Generator().manual_seed(seed)
    state, eos_ids = _state(gen), torch.tensor([V - 1, 3])
    plan = _plan(state, gen, rows)
    logits = torch.randn(rows + prompt_rows, V, generator=gen) * 3
    logits[:, 255] = logits[:, 256] = logits.amax(-1) + 1  # a tie at the top across two chunks: the lower id wins
    tokens = state.tokens[:, :MAX_LEN].long()
    for slot in range(S):  # some held and biased ids at the top, so holding them back changes the token
        logits[:rows][plan.sample_slot == slot, state.stop_ids[slot, 0]] += 10
        logits[:rows][plan.sample_slot == slot, tokens[slot, 0]] += 8
    read, expected, scores = _expected(logits, state, plan, features, eos_ids, rows, prompt_rows)

    got_read, prompt = KERNELS.rows_read(state, plan, B, rows, prompt_rows)
    assert torch.equal(got_read, read)
    raw = logits.clone()
    got, got_scores = KERNELS.sample(logits, state, plan, rows, prompt, features, eos_ids)
    assert torch.equal(logits, raw)  # the edits were undone
    assert torch.equal(got.tokens, expected.tokens)
    assert not tickets("step sampler", logits.device, 1).any()  # every row's last chunk left its ticket at zero
    if features.logprobs:
        asked = state.logprobs[plan.sample_slot[:rows]] >= 0
        torch.testing.assert_close(got.logprob[asked], expected.logprob[asked], atol=1e-5, rtol=1e-5)
        # Equal logits may come in either order (torch's topk promises none).
        assert torch.equal(got.top_ids[asked].sort(-1).values, expected.top_ids[asked].sort(-1).values)
        torch.testing.assert_close(got.top_logprobs[asked], expected.top_logprobs[asked], atol=1e-5, rtol=1e-5)
        assert bool((got.top_ids[~asked] == -1).all()) and bool((got.logprob[~asked] == 0).all())
    else:
        assert got.logprob is None and expected.logprob is None
    if prompt_rows:
        real = scores.slot >= 0
        assert bool(real.any()) and bool((~real).any())  # scored rows and padding both met
        for name in ("slot", "token", "first", "count"):
            assert torch.equal(getattr(got_scores, name), getattr(scores, name)), name
        torch.testing.assert_close(got_scores.logprob[real], scores.logprob[real], atol=1e-5, rtol=1e-5)
        assert torch.equal(got_scores.top_ids[real].sort(-1).values, scores.top_ids[real].sort(-1).values)
        torch.testing.assert_close(got_scores.top_logprobs[real], scores.top_logprobs[real], atol=1e-5, rtol=1e-5)
    else:
        assert got_scores is None


def test_each_row_pays_for_what_it_asked():
    """A greedy row without logprobs reads its logits once; logprobs add the pass of their chunks' scoring (which
    settles the top here: a row of noise's top 20 lies among its chunks' candidates)."""
    gen = torch.Generator().manual_seed(5)
    state = _state(gen)
    plan = _plan(state, gen, S)
    logits = torch.randn(S, V, generator=gen)
    out, _ = KERNELS.sample(logits, state, plan, S, None, ALL, torch.tensor([V - 1]))
    passes = dict(zip(plan.sample_slot.tolist(), out.passes.tolist(), strict=True))
    assert passes[0] == 1  # greedy, no logprobs
    assert passes[1] == 2  # plain sampling, and logprobs
    assert passes[2] == 2  # min-p: its plan, then the draw


def test_the_triton_step_serves_every_feature_as_the_torch_one(checkpoint, monkeypatch):
    """Whole steps: the Triton kernel set (the step kernels) and the torch one (gathers and `sample`) give the same
    tokens, logprobs and prompt logprobs to requests that use every sampling feature side by side."""
    from blink.engine import LLM, SamplingParams

    # The second request's bias would pick token 100 at once, but 100 stops it, held back for min_tokens.
    prompts = [list(range(3, 12)), [*range(20, 45), 483, 537, 340, 727], [7] * 6]
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=5, max_tokens=5, logprobs=3,
                             repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                             logit_bias={30: 3.0, 31: -2.0}, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=6, min_tokens=4, stop_token_ids=[100, 41], logprobs=0,
                             repetition_penalty=3.0, presence_penalty=2.0, logit_bias={100: 6.0}),
              SamplingParams(temperature=1.2, seed=9, max_tokens=5, repetition_penalty=0.8)]
    results = {}
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("BLINK_KERNELS", kernels)
        llm = LLM(str(checkpoint("mistral")), max_num_seqs=4, max_num_batched_tokens=32, num_pages=40, page_size=8,
                  max_model_len=64)
        assert (llm.engine.step.sampler.step is not None) == (kernels == "triton")
        results[kernels] = llm.generate(prompts, params)
    for expected, got in zip(results["torch"], results["triton"], strict=True):
        assert got.token_ids == expected.token_ids
        for want, have in zip([*(expected.logprobs or []), *(expected.prompt_logprobs or [])[1:]],
                              [*(got.logprobs or []), *(got.prompt_logprobs or [])[1:]], strict=True):
            assert have.keys() == want.keys()
            for token, logprob in want.items():
                assert have[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)
    assert len(results["torch"][0].prompt_logprobs) == len(prompts[0])
    assert results["torch"][1].token_ids[-1] == 100 and len(results["torch"][1].token_ids) == 5  # held, then stopped
