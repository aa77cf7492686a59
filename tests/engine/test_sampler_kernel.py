"""The fused sampler kernels against the torch sampler (in Triton's interpreter without a GPU): the same tokens
for greedy and seeded rows in batches of mixed features, the same logprobs, and the passes each row paid for."""

from __future__ import annotations

import pytest
import torch

from blink.engine.core.sampler import SamplerFeatures, SamplingRows, hash32, sample
from blink.engine.kernels.sampler import fused_sample

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
V = 700  # three blocks of BLOCK (and chunks of the draw), the last one partial
BLOCK = 256
CHUNK = 256
ALL = SamplerFeatures(**dict.fromkeys(SamplerFeatures.__dataclass_fields__, True))

# One row each: (temperature, top_p, top_k, min_p); repeated with other seeds and logits.
KINDS = [
    (0.0, 1.0, 0, 0.0),  # greedy
    (0.0, 0.5, 7, 0.2),  # greedy with filters set (they do not apply)
    (1.0, 1.0, 0, 0.0),  # plain sampling
    (0.7, 1.0, 0, 0.05),  # min-p
    (1.3, 1.0, 40, 0.0),  # top-k
    (1.0, 0.9, 0, 0.0),  # top-p
    (0.8, 0.7, 100, 0.01),  # all three
    (1.0, 1.0, 1, 0.0),  # top-k 1: greedy by another road
    (2.0, 0.05, 0, 0.0),  # top-p that keeps one token
    (1.0, 1.0, 5000, 0.0),  # top-k beyond the vocabulary
]


def _rows(n: int, gen: torch.Generator, logprobs: bool) -> SamplingRows:
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    rows = SamplingRows(
        temperature=torch.tensor([k[0] for k in kinds]), top_p=torch.tensor([k[1] for k in kinds]),
        top_k=torch.tensor([k[2] for k in kinds]), min_p=torch.tensor([k[3] for k in kinds]),
        repetition_penalty=1 + torch.rand(n, generator=gen), presence_penalty=torch.rand(n, generator=gen) - 0.5,
        frequency_penalty=torch.rand(n, generator=gen) - 0.5,
        seed=torch.randint(0, 2**62, (n,), generator=gen), step_index=torch.randint(0, 500, (n,), generator=gen),
    )
    rows.held = torch.where(torch.rand(n, 3, generator=gen) < 0.5, torch.randint(0, V, (n, 3), generator=gen), -1)
    rows.bias_ids = torch.where(torch.rand(n, 4, generator=gen) < 0.5, torch.randperm(V, generator=gen)[:4], -1)
    rows.bias = torch.randn(n, 4, generator=gen) * 5
    if logprobs:
        rows.logprobs = torch.where(torch.arange(n) % 4 == 1, torch.arange(n) % 21, -1)  # a few: interpreted, slow
    return rows


def _penalties(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    seen = torch.randint(0, V, (n, 30), generator=gen)
    seen[:, 20:] = -1
    seen[-1] = -1  # a row with no tokens
    return seen, torch.randint(0, 3, (n, 30), generator=gen, dtype=torch.int32)


def _on(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("features, seed", [(ALL, 0), (ALL, 1), (SamplerFeatures(random=True, filtering=True), 2),
                                           (SamplerFeatures(), 3)], ids=["every-feature", "every-feature-again",
                                                                         "filters", "greedy"])
def test_fused_sampler_draws_the_references_tokens(features, seed):
    gen = torch.Generator().manual_seed(seed)
    n = 2 * len(KINDS)
    logits = torch.randn(n, V, generator=gen) * 3
    # A tie at the top, across two of the draw's chunks: the lower id wins either way.
    logits[:, CHUNK - 1] = logits[:, CHUNK] = logits.amax(-1) + 1
    rows = _rows(n, gen, features.logprobs)
    if not features.random:
        rows.temperature.zero_()
    seen, counts = _penalties(n, gen)
    expected = sample(logits, rows, features, hash32(torch.arange(V)), seen, counts)

    device_rows = SamplingRows(**{k: _on(v) for k, v in vars(rows).items()})
    on_device = logits.to(DEVICE)
    got = fused_sample(on_device, device_rows, features, None, seen.to(DEVICE), counts.to(DEVICE), block=BLOCK,
                       chunk=CHUNK)
    assert torch.equal(got.tokens.cpu(), expected.tokens)
    assert torch.equal(on_device.cpu(), logits)  # the edits were undone
    if features.logprobs:
        asked = rows.logprobs >= 0
        torch.testing.assert_close(got.logprob.cpu()[asked], expected.logprob[asked], atol=1e-5, rtol=1e-5)
        # Equal logits may come in either order (torch's topk promises none).
        assert torch.equal(got.top_ids.cpu()[asked].sort(-1).values, expected.top_ids[asked].sort(-1).values)
        torch.testing.assert_close(got.top_logprobs.cpu()[asked], expected.top_logprobs[asked], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [128, CHUNK, 4096])
def test_the_draw_over_chunks_is_torchs_argmax(chunk):
    """However the vocabulary is cut among the draw's programs, a greedy row's token is torch's argmax: ties between
    chunks go to the lower id, and a chunk of nothing but -inf (held ids, a grammar's mask) loses to any other."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, V, generator=gen)
    logits[0, CHUNK - 1] = logits[0, CHUNK] = 9.0  # a tie across a boundary (within one chunk at 4096)
    logits[1, 2 * CHUNK + 5] = logits[1, 10] = 9.0
    logits[2, :CHUNK] = float("-inf")
    logits[3, :-1] = float("-inf")  # one id left, in the last chunk
    logits[4] = float("-inf")  # nothing left: id 0, as torch's argmax
    rows = _rows(5, gen, logprobs=False)
    rows.temperature.zero_()
    device_rows = SamplingRows(**{k: _on(v) for k, v in vars(rows).items()})
    got = fused_sample(logits.to(DEVICE), device_rows, SamplerFeatures(), None, block=BLOCK, chunk=chunk).tokens
    expected = logits.argmax(-1)
    assert torch.equal(got.cpu(), expected)
    assert expected[[0, 1, 3, 4]].tolist() == [CHUNK - 1, 10, V - 1, 0] and expected[2] >= CHUNK


def test_each_row_pays_for_what_it_asked():
    """A greedy or plain sampling row is one pass over its logits; a filtering row adds its plan's pass, and a search
    of at most nine passes per threshold only where its chunks' candidates cannot settle it (the nucleus of a flat
    row); logprobs a pass, which its candidates settle here."""
    gen = torch.Generator().manual_seed(3)
    rows = _rows(len(KINDS), gen, logprobs=True)
    rows.logprobs = torch.full((len(KINDS),), -1)
    rows.logprobs[2] = 5
    logits = torch.randn(len(KINDS), V, generator=gen)
    device_rows = SamplingRows(**{k: _on(v) for k, v in vars(rows).items()})
    passes = fused_sample(logits.to(DEVICE), device_rows, ALL, None, *(t.to(DEVICE) for t in _penalties(
        len(KINDS), gen)), block=BLOCK, chunk=CHUNK).passes.cpu().tolist()
    assert passes[0] == passes[1] == 1  # greedy (filters set or not)
    assert passes[2] == 2  # plain sampling, and logprobs: the draw, and the chunks' scoring (candidates settle it)
    assert [passes[row] for row in (3, 4, 6, 7, 8, 9)] == [2] * 6  # min-p, top-k, all three...: settled
    assert 2 + 6 <= passes[5] <= 2 + 9  # top-p 0.9 of noise needs most of the row: searched whole


@pytest.mark.parametrize("chunk", [128, 1024])
def test_the_filters_plan_keeps_what_the_references_filters_keep(chunk):
    """Whether a row's chunks' candidates settle its thresholds (a peaked row, a strong min-p) or the row is searched
    whole (a flat one), the draw keeps exactly the tokens the reference keeps: min-p, then top-k, then top-p, with
    ties at the top, -inf logits and a k past the vocabulary."""
    from blink.engine.core.sampler import filtered
    from blink.engine.kernels.sampler import plan_draw

    gen = torch.Generator().manual_seed(11)
    n = 60
    logits = torch.randn(n, V, generator=gen) * torch.tensor([0.3, 3.0, 12.0]).repeat(n // 3)[:, None]
    logits[::4, 5:40] = logits[::4].amax(-1, keepdim=True) - 0.5  # a band of equal values near the top
    logits[1::4, :100] = float("-inf")
    pick = lambda options: torch.tensor(options)[torch.randint(0, len(options), (n,), generator=gen)]  # noqa: E731
    rows = SamplingRows(temperature=0.5 + 1.5 * torch.rand(n, generator=gen), top_p=pick([1.0, 0.05, 0.5, 0.9, 0.99]),
                        top_k=pick([0, 0, 1, 5, 40, 300, 5000]), min_p=pick([0.0, 0.0, 0.01, 0.2]),
                        repetition_penalty=torch.ones(n), presence_penalty=torch.zeros(n),
                        frequency_penalty=torch.zeros(n), seed=torch.zeros(n, dtype=torch.int64),
                        step_index=torch.zeros(n, dtype=torch.int64))
    rows.top_p[(rows.top_k == 0) & (rows.min_p == 0)] = 0.9  # every row filters
    draw, passes = plan_draw(logits.to(DEVICE), SamplingRows(**{k: _on(v) for k, v in vars(rows).items()}),
                             BLOCK, chunk)
    draw, passes = draw.cpu(), passes.cpu()
    words = draw.view(torch.float32)
    scaled = logits / words[:, :1]
    bits = torch.where(scaled == 0, 0.0, scaled).view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    kept = ((scaled - words[:, 2:3] >= words[:, 1:2]) & (key >= draw[:, 3:4]) & (key >= draw[:, 4:5])
            & (scaled > float("-inf")))
    assert torch.equal(words[:, 2], scaled.amax(-1))
    assert torch.equal(kept, filtered(scaled, rows))
    assert bool((passes == 2).any()) and bool((passes > 2).any())  # both roads taken


def test_equal_logits_stay_or_go_together():
    """Filters keep values: tokens tied at top-k's or top-p's boundary are all kept, in both samplers."""
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2, 1e-3] + [1e-6] * 95]))
    rows = SamplingRows(temperature=torch.ones(1), top_p=torch.ones(1), top_k=torch.tensor([2]),
                        min_p=torch.zeros(1), repetition_penalty=torch.ones(1), presence_penalty=torch.zeros(1),
                        frequency_penalty=torch.zeros(1), seed=torch.zeros(1, dtype=torch.int64),
                        step_index=torch.zeros(1, dtype=torch.int64))
    features = SamplerFeatures(random=True, filtering=True)
    n = 60  # draws, through as many seeds
    for top_k, top_p in ((2, 1.0), (0, 0.5)):
        rows.top_k[0], rows.top_p[0] = top_k, top_p
        draws = SamplingRows(**{k: v.expand(n).clone() for k, v in vars(rows).items() if v is not None})
        draws.seed = torch.arange(n)
        expected = sample(logits.expand(n, -1), draws, features, hash32(torch.arange(100))).tokens
        on_device = SamplingRows(**{k: _on(v) for k, v in vars(draws).items()})
        assert torch.equal(fused_sample(logits.expand(n, -1).contiguous().to(DEVICE), on_device, features,
                                        None).tokens.cpu(), expected)
        assert set(expected.tolist()) == {0, 1, 2, 3}, (top_k, top_p)


def test_token_logprobs_score_the_rows_that_asked():
    """The prompt's logprobs go through the same kernel: a given token per row, rows past the scored ones skipped."""
    from blink.engine.core.sampler import token_logprobs
    from blink.engine.kernels.sampler import token_logprobs as fused_token_logprobs

    gen = torch.Generator().manual_seed(4)
    logits, tokens = torch.randn(6, V, generator=gen) * 4, torch.randint(0, V, (6,), generator=gen)
    asked = torch.tensor([0, 0, 0, 0, -1, -1])
    logprob, top_ids, top_logprobs = fused_token_logprobs(logits.to(DEVICE), tokens.to(DEVICE), asked.to(DEVICE),
                                                          block=BLOCK)
    expected = token_logprobs(logits, tokens)
    torch.testing.assert_close(logprob.cpu()[:4], expected[0][:4], atol=1e-5, rtol=1e-5)
    assert torch.equal(top_ids.cpu()[:4], expected[1][:4])
    torch.testing.assert_close(top_logprobs.cpu()[:4], expected[2][:4], atol=1e-5, rtol=1e-5)
    assert bool((top_ids[4:] == -1).all()) and bool((logprob[4:] == 0).all())


@pytest.mark.parametrize("scale, whole", [(0.1, False), (1.0, True)], ids=["among-candidates", "searched-whole"])
def test_the_top_logprobs_survive_many_ties_at_the_last_place(scale, whole):
    """19 logits above 40 equal ones that the 20th place ties: every one above is kept whatever the ids' order, and
    the lowest tied id takes the last place; whether the chunks' candidates hold them all (close together: one pass)
    or not (spread wider than the candidates' histogram: the row searched whole)."""
    from blink.engine.core.sampler import token_logprobs
    from blink.engine.kernels.logprobs import logprobs

    logits = torch.zeros(1, V)
    logits[0, 100:140] = 5.0 * scale  # the ties, at low ids
    logits[0, V - 19:] = (torch.arange(19) + 6.0) * scale  # above them, at the highest ids
    tokens = torch.tensor([3])
    _, top_ids, top_logprobs, paid = logprobs(logits.to(DEVICE), torch.zeros_like(tokens).to(DEVICE),
                                              tokens.to(DEVICE), block=BLOCK)
    expected = token_logprobs(logits, tokens)
    torch.testing.assert_close(top_logprobs.cpu(), expected[2], atol=1e-5, rtol=1e-5)
    assert top_ids[0, :19].tolist() == list(range(V - 1, V - 20, -1)) and top_ids[0, 19].item() == 100
    assert (paid.item() > 1) == whole  # the chunks' pass, then a search and a pass more where searched whole


def test_a_row_masked_down_to_a_few_tokens_scores_them():
    """A grammar's mask leaves a row -inf but for a few ids past its first blocks (fewer than the top's 20, so the
    row is scored whole): the log-sum-exp starts on blocks of nothing but -inf and must not make them NaN."""
    from blink.engine.core.sampler import token_logprobs
    from blink.engine.kernels.logprobs import logprobs

    logits = torch.full((1, V), float("-inf"))
    logits[0, V - 5:] = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.5])
    tokens = torch.tensor([V - 2])
    logprob, top_ids, top_logprobs, _ = logprobs(logits.to(DEVICE), torch.zeros_like(tokens).to(DEVICE),
                                                 tokens.to(DEVICE), block=BLOCK)
    expected = token_logprobs(logits, tokens)
    torch.testing.assert_close(logprob.cpu(), expected[0], atol=1e-5, rtol=1e-5)
    assert top_ids[0, :5].tolist() == [V - 4, V - 1, V - 3, V - 5, V - 2]
    torch.testing.assert_close(top_logprobs.cpu()[0, :5], expected[2][0, :5], atol=1e-5, rtol=1e-5)
