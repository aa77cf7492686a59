"""Speculative decoding with a draft model (engine/core/draft_model.py): the target's own tokens, greedy and seeded,
whatever the draft proposes; a draft that is the target itself has every draft accepted (its KV kept in step with the
target's through prefills, rejections and full acceptances); every page back; the device step under Triton's
interpreter; a draft that cannot draft for the model refused with the reason."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from blink.engine import LLM, SamplingParams
from blink.engine.engine import Engine, EngineConfig
from blink.shared.slot_table import Finish
from tests.engine.test_speculation_device import MIXED, _serve

# float32: a verification's multi-token forward rounds as plain decoding's to float32's noise (test_speculation.py).
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=128, dtype="float32")
# A prompt longer than the budget (prefilled in chunks, the draft's KV with it), a repetitive one and a short one.
PROMPTS = [list(range(3, 90)), [5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 11, 12]]


def _draft(model, k: int = 3) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


def _drafting(llm):
    """The engine (or LLM) with its draft's cost taken as nothing: these drafts are as costly as the model, which the
    policy would rightly stop drafting with (test_the_policy_weighs_the_draft_s_forwards); the mechanism is tested."""
    engine = getattr(llm, "engine", llm)
    engine.step.speculation = dataclasses.replace(engine.step.speculation, draft_ratio=0.0)
    return llm


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two random checkpoints of one tokenizer: the target and a different model as its draft."""
    from blink.engine.model.tiny_model import train_tokenizer
    from tests.conftest import build_checkpoint

    tokenizer = tmp_path_factory.mktemp("draft-tokenizer")
    train_tokenizer().save(str(tokenizer / "tokenizer.json"))
    return {kind: build_checkpoint(kind, tmp_path_factory.mktemp(kind), tokenizer) for kind in ("qwen3", "llama-gqa")}


@pytest.fixture(scope="module")
def plain(models) -> LLM:
    return LLM(str(models["qwen3"]), **ENGINE)


def _generate(llm: LLM, params) -> list:
    return llm.generate([*PROMPTS, PROMPTS[1]], params)


def test_a_draft_that_is_the_model_has_every_draft_accepted(models, plain):
    llm = _drafting(LLM(str(models["qwen3"]), **ENGINE, speculative_config=_draft(models["qwen3"], 4)))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, got = _generate(plain, params), _generate(llm, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    drafts, draft_tokens, accepted = llm.engine.state.spec_counts.tolist()
    # Its drafts are the target's own argmax wherever its KV is right: after a prefill in chunks, and after steps
    # whose drafts were all accepted (the last draft's KV written by a forward of its own).
    assert drafts > 10 and accepted >= 0.98 * draft_tokens
    assert int(llm.engine.pool.num_free) == llm.engine.pool.usable_pages


@pytest.mark.parametrize("k", [1, 4])
def test_another_draft_s_rejections_leave_the_model_s_tokens(models, plain, k):
    llm = _drafting(LLM(str(models["qwen3"]), **ENGINE, speculative_config=_draft(models["llama-gqa"], k)))
    greedy = [SamplingParams(temperature=0, max_tokens=30, logprobs=2)] * 3 + [
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3)]  # penalised: decodes plainly
    want, got = plain.generate([*PROMPTS, PROMPTS[1]], greedy), llm.generate([*PROMPTS, PROMPTS[1]], greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want[:3], got[:3], strict=True):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    # Seeded sampling draws each position's own noise: the same tokens with drafts as without.
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=30, ignore_eos=True)
    assert [o.token_ids for o in _generate(llm, seeded)] == [o.token_ids for o in _generate(plain, seeded)]
    drafts, draft_tokens, accepted = llm.engine.state.spec_counts.tolist()
    assert drafts > 0 and draft_tokens > accepted  # it drafted, and some drafts were rejected
    assert int(llm.engine.pool.num_free) == llm.engine.pool.usable_pages


def test_max_tokens_and_stop_ids_inside_a_run_end_it_there(models, plain):
    llm = _drafting(LLM(str(models["qwen3"]), **ENGINE, speculative_config=_draft(models["qwen3"], 4)))
    reference = plain.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    for max_tokens in (2, 5, 7):
        out = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        assert out.token_ids == reference.token_ids[:max_tokens] and out.finish_reason == "length"
    stop = next(t for i, t in enumerate(reference.token_ids) if i >= 3 and t not in reference.token_ids[:i])
    out = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))[0]
    assert out.token_ids == reference.token_ids[:reference.token_ids.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_a_draft_with_fewer_token_embeddings_reads_the_ones_it_lacks_as_its_last(models, plain, tmp_path):
    """A draft whose vocabulary stops short of the model's (as Qwen2.5-0.5B's 151,936 against 7B's 152,064): prompt
    ids past it are read as its last; the model's tokens come out."""
    from safetensors.torch import load_file, save_file

    small = tmp_path / "small"
    shutil.copytree(models["llama-gqa"], small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    weights = load_file(small / "model.safetensors")
    save_file({name: t[:1000].contiguous() if name in ("model.embed_tokens.weight", "lm_head.weight") else t
               for name, t in weights.items()}, small / "model.safetensors", metadata={"format": "pt"})
    llm = _drafting(LLM(str(models["qwen3"]), **ENGINE, speculative_config=_draft(small)))
    prompts = [[1100, 1150, 1173, 5, 6, 1100, 1150], PROMPTS[1]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert int(llm.engine.state.spec_counts[0]) > 0


def test_rotated_pages_carry_the_draft_s_kv_out_and_back(models, plain):
    """KV rotation under a pool too small for the batch: the draft's KV leaves and comes back with the model's pages,
    so a draft that is the model still has every draft accepted (pages coming back with another request's draft KV
    would have their drafts rejected); the tokens are the model's, nothing recomputed."""
    prompts = [list(range(3 + i, 40 + i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight = dict(ENGINE, max_model_len=96, num_pages=16, swap_space=1)  # 15 pages of 8: under two 77-token sequences
    llm = _drafting(LLM(str(models["qwen3"]), **tight, speculative_config=_draft(models["qwen3"], 3)))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    engine = llm.engine
    out, back = engine.mirror.pages_moved.tolist()
    assert out > 0 and back == out and int(engine.state.num_recomputes) == 0
    _, draft_tokens, accepted = engine.state.spec_counts.tolist()
    assert draft_tokens > 0 and accepted >= 0.98 * draft_tokens


def test_the_device_step_drafts_with_a_draft_model(models):
    """The graph and persistent modes' step, eagerly with its kernels in Triton's interpreter: every slot's row in
    each draft forward, K forwards, the tokens plain decoding's (a draft that is the model: all accepted)."""
    from blink.engine.model.tiny_model import ensure_tiny_model

    greedy = {slot: request for slot, request in MIXED.items() if request.temperature == 0}  # drafts all accepted
    plain, _ = _serve(None, greedy)
    served, engine = _serve(_draft(ensure_tiny_model(), 3), greedy, prepare=_drafting)
    for slot in greedy:
        assert served.tokens(slot) == plain.tokens(slot), slot
        assert served.finish[slot] == Finish.LENGTH
    _, draft_tokens, accepted = engine.state.spec_counts.tolist()
    assert draft_tokens > 0 and accepted >= 0.98 * draft_tokens
    assert max(len(step) for step in served.steps[0]) > 1


def _edited(source, target, name: str, edit) -> str:
    """A copy of checkpoint `source` whose JSON file `name` went through `edit`."""
    shutil.copytree(source, target)
    (target / name).write_text(json.dumps(edit(json.loads((target / name).read_text()))))
    return str(target)


def _swap_two_tokens(tokenizer: dict) -> dict:
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return tokenizer


def test_the_policy_weighs_the_draft_s_forwards(models):
    """A draft model's forward a draft token joins what a draft costs (Speculation.threshold): a draft as costly as
    the model never pays, one a fifth of it does at a good rate; the ratio is the layers' and weight bytes' mean."""
    import torch

    from blink.engine.core.policy import StepCost, policy_named
    from blink.engine.core.speculation import Speculation
    from blink.engine.core.state import Slots

    state = Slots(2, max_len=64, max_pages=8, vocab_size=8, device=torch.device("cpu"))
    state.seq_len.fill_(10)
    state.num_computed.fill_(9)
    cost = StepCost(torch.device("cpu"))
    cost.fit.copy_(torch.tensor([0.010, 0.001], dtype=torch.float64))  # 10 ms a step + 1 ms a token
    take, able = torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.bool)

    def need(ratio: float) -> float:
        speculation = Speculation(4, 1, 1, lookup=False, draft_ratio=ratio)
        return float(speculation.threshold(state, policy_named("fcfs"), cost, take, able)[0])

    step = 0.010 + 0.001 * 2
    assert need(0.0) == pytest.approx(2 * 0.001 / step)
    assert need(1.0) == pytest.approx(2 * 0.001 * 3 / step + 0.010 / step) and need(1.0) > 1  # never pays
    assert need(0.2) < 0.6
    engine = Engine(EngineConfig(model=str(models["qwen3"]), **ENGINE, speculative_config=_draft(models["qwen3"])))
    assert engine.step.speculation.draft_ratio == pytest.approx(1.0)  # the model itself: as costly
    assert engine.step.drafter.cost_ratio(engine.model) == pytest.approx(1.0)


def test_a_draft_that_cannot_draft_for_the_model_is_refused(models, tmp_path):
    target = str(models["qwen3"])
    other = _edited(models["llama-gqa"], tmp_path / "other", "tokenizer.json", _swap_two_tokens)
    with pytest.raises(ValueError, match="another tokenizer"):
        Engine(EngineConfig(model=target, **ENGINE, speculative_config=_draft(other)))
    short = _edited(models["llama-gqa"], tmp_path / "short", "config.json",
                    lambda config: {**config, "max_position_embeddings": 64})
    with pytest.raises(ValueError, match="reads 64 positions at most: set max_model_len"):  # 128 asked for
        Engine(EngineConfig(model=target, **ENGINE, speculative_config=_draft(short)))
    unset = {k: v for k, v in ENGINE.items() if k != "max_model_len"}  # the model's 256 cut to the draft's
    assert Engine(EngineConfig(model=target, **unset, speculative_config=_draft(short))).max_model_len == 64
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        Engine(EngineConfig(model=target, **ENGINE, tensor_parallel_size=2, speculative_config=_draft(target)))
    with pytest.raises(ValueError, match="needs the draft's"):
        Engine(EngineConfig(model=target, **ENGINE, speculative_config={"method": "draft_model",
                                                                          "num_speculative_tokens": 2}))

