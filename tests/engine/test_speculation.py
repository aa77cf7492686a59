"""Speculative decoding in the step (engine/core/speculation.py): the same tokens as plain decoding (greedy and seeded),
stops and limits exact inside an accepted run, every page back, no host read in the step, the offline API and the
host driver alike."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core.sampler import SamplerFeatures, SamplingRows, hash32, sample
from blink.engine.core.speculation import Speculation
from blink.engine.core.state import Slots, SlotStatus
from blink.engine.drive.host import HostDriver, _events
from blink.engine.engine import Engine, EngineConfig
from blink.engine.kernels import commit
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.slot_table import Finish, Request
from blink.shared.speculative import speculative_config
from tests.engine.test_commit_kernel import cpp_kernels
from tests.support.host_reads import host_reads_forbidden

# Prompts whose continuation the tiny random model repeats, so drafts are found and accepted; and one with no repeat.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11], list(range(3, 40))]
# float32: the verification's multi-token forward rounds as the single-token one does only to float32's noise,
# far below the tiny model's logit gaps (in bfloat16, ties a few ulps apart can flip: docs/design.md).
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=128, dtype="float32")


def _spec(k: int, lookup_min: int = 1, lookup_max: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_max}


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(str(ensure_tiny_model()), **ENGINE)


@pytest.fixture(scope="module")
def speculating() -> dict[int, LLM]:
    return {k: LLM(str(ensure_tiny_model()), **ENGINE, speculative_config=_spec(k)) for k in (1, 3, 5)}


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_text_is_plain_decoding_s_with_drafts_accepted(plain, speculating, k):
    llm = speculating[k]
    free = int(llm.engine.pool.num_free)
    accepted_before = int(llm.engine.state.spec_counts[2])
    # A penalised request decodes plainly beside the speculating ones; logprobs stay per token.
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=2)] * 3 + [
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)]
    prompts = [*PROMPTS, PROMPTS[0]]
    want, got = plain.generate(prompts, params), llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want[:3], got[:3], strict=True):
        assert len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert int(llm.engine.state.spec_counts[2]) > accepted_before  # drafts were accepted, not only proposed
    assert int(llm.engine.pool.num_free) == free


def test_stop_ids_and_max_tokens_inside_an_accepted_run_end_it_there(plain, speculating):
    llm = speculating[5]
    reference = _tokens(plain, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=30))
    ended_inside = 0
    for max_tokens in range(2, 14):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        assert _tokens(llm, PROMPTS[:2], params) == [r[:max_tokens] for r in reference]
    for i, ref in enumerate(reference):
        for stop in set(ref[3:12]):
            params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
            out = llm.generate([PROMPTS[i]], params)[0]
            cut = ref.index(stop) + 1
            assert out.token_ids == ref[:cut] and out.finish_reason == "stop"
    # Driven step by step: a run of several tokens that a limit ended.
    driver = llm._driver
    for max_tokens in range(3, 12):
        driver.add_request(f"m{max_tokens}", PROMPTS[0], SamplingParams(temperature=0, max_tokens=max_tokens),
                           max_tokens)
    while driver.has_work():
        for e in driver.step():
            ended_inside += bool(e.finish_reason == "length" and len(e.tokens) > 1)
    assert ended_inside > 0


def test_eos_inside_an_accepted_run_ends_it(speculating):
    """eos is one of the stop checks per emitted token: a run whose draft holds the model's end token stops there."""
    llm = speculating[3]
    eos = llm.engine.generation.eos_token_ids[0]
    prompt = [eos, 7, 8, 9, eos, 7, 8, 9, eos, 7, 8]
    # The model's own greedy choice decides; either way the tokens after an eos are never emitted.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert eos not in out.token_ids[:-1]
    assert out.finish_reason == ("stop" if out.token_ids[-1] == eos else "length")


def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts(plain, speculating):
    llm = speculating[3]
    for seed in range(12):
        params = SamplingParams(temperature=0.3, top_k=5, max_tokens=16, seed=seed, logprobs=1)
        assert _tokens(llm, PROMPTS[:2], params) == _tokens(plain, PROMPTS[:2], params), seed


# The settles: the torch reference (None), the CPU's C++ and the device step's Triton (in Triton's interpreter, ~9 ms
# a slot: fewer slots, wider bounds).
SETTLES = {"torch": lambda: None, "cpp": lambda: cpp_kernels().settle_runs, "triton": lambda: commit.settle_runs}


@pytest.mark.parametrize(("settle", "n"), [("torch", 4000), ("cpp", 4000), ("triton", 600)])
def test_drafts_are_accepted_with_the_target_s_probabilities_and_the_output_distribution_kept(settle, n):
    """settle on crafted logits over a 6-token vocabulary, top-k 3, runs of two drafts, a slot per seed: each row
    draws from its position's filtered distribution q_i (plain decoding's draw there); draft i is accepted exactly when
    its row drew it and the drafts before it were accepted (probability q_0(d_0) q_1(d_1) for both: rejection sampling
    of point-mass drafts), and the tokens emitted are the rows' draws up to the first that differs from its draft, so
    the first is distributed as q_0, the second as q_1 after an accepted d_0, none outside the top 3."""
    V, K, top_k = 6, 2, 3
    p = torch.tensor([[0.05, 0.30, 0.25, 0.10, 0.20, 0.10],  # position 0: top 3 = {1, 2, 4}
                      [0.35, 0.05, 0.10, 0.25, 0.05, 0.20],  # position 1: {0, 3, 5}
                      [0.05, 0.15, 0.40, 0.08, 0.25, 0.07]])  # the bonus row: {1, 2, 4}
    q = torch.where(p >= p.topk(top_k, dim=1).values[:, -1:], p, 0)
    q /= q.sum(1, keepdim=True)
    drafts = [2, 3]  # in their positions' top 3, neither the likeliest
    state = Slots(n, max_len=8, max_pages=2, vocab_size=V, device=torch.device("cpu"))
    state.status.fill_(SlotStatus.RUNNING)
    state.prompt_len.fill_(3)
    state.seq_len.fill_(3)
    state.num_computed.fill_(5)  # after the step's advance: 2 + the last token + two drafts
    state.max_tokens.fill_(5)
    state.draft_len.fill_(K)
    state.tokens[:, 3:5] = torch.tensor(drafts, dtype=torch.int32)
    R = n * (K + 1)
    slot, i = torch.arange(n).repeat_interleave(K + 1), torch.arange(K + 1).repeat(n)
    rows = SamplingRows(temperature=torch.ones(R), top_p=torch.ones(R), top_k=torch.full((R,), top_k),
                        min_p=torch.zeros(R), repetition_penalty=torch.ones(R), presence_penalty=torch.zeros(R),
                        frequency_penalty=torch.zeros(R), seed=slot * 7919 + 1, step_index=i)
    logits = p.log()[i]
    out = sample(logits, rows, SamplerFeatures(random=True, filtering=True), hash32(torch.arange(V)))
    plan = SimpleNamespace(sample_slot=slot, sample_valid=torch.ones(R, dtype=torch.bool), sample_token=torch.arange(R),
                           token_pos=i + 2)

    speculation = dataclasses.replace(Speculation(K, 1, 1), settle_kernel=SETTLES[settle]())
    settled = speculation.settle(state, plan, R, out, logits, torch.tensor([-1]), False)
    draws, count = out.tokens.view(n, K + 1), settled.runs.count
    first, second = draws[:, 0], draws[:, 1]
    assert torch.equal(count, torch.where(first != drafts[0], 1, torch.where(second != drafts[1], 2, 3)))
    emitted = torch.arange(K + 1) < count[:, None]
    assert torch.equal(settled.runs.token, torch.where(emitted, draws, -1))  # the draws themselves, in order

    def within_bounds(tokens: torch.Tensor, q: torch.Tensor) -> None:
        """tokens' frequencies are q's within 2 / sqrt(count), four standard deviations at least; none where q is 0."""
        freq = torch.bincount(tokens, minlength=V).float() / len(tokens)
        assert torch.equal(freq > 0, q > 0) and (freq - q).abs().max() < 2 / len(tokens) ** 0.5, (freq, q)

    within_bounds(first, q[0])
    within_bounds(second[first == drafts[0]], q[1])
    assert not (draws[count == 3, 2][:, None] == torch.tensor([0, 3, 5])).any()  # the bonus row's top 3 only
    both = (count == 3).float().mean()
    assert abs(both - q[0, drafts[0]] * q[1, drafts[1]]) < 2 / n ** 0.5
    assert torch.equal(state.seq_len, 3 + count)
    assert torch.equal(state.num_computed, 2 + count)  # the valid KV only
    accepted = [int((count > 1).sum()), int((count > 2).sum())]
    assert state.spec_counts.tolist() == [n, K * n, sum(accepted)]
    assert state.spec_accepted_per_pos[:K].tolist() == accepted


def test_no_page_is_lost_to_rejections_cancels_or_finishes_inside_a_run(speculating):
    llm = speculating[5]
    driver, pool = llm._driver, llm.engine.pool
    free = int(pool.num_free)
    for i, prompt in enumerate(PROMPTS * 2):
        driver.add_request(str(i), prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=40), 40)
    steps = 0
    while driver.has_work():
        driver.step()
        steps += 1
        if steps == 4:
            driver.abort("1")
            driver.abort("4")
    assert int(pool.num_free) == free
    assert int(llm.engine.state.draft_len.sum()) == 0


def test_the_step_reads_nothing_on_the_host_while_speculating():
    # Prefix caching's own reads are tests/engine/test_step.py's to check: off here, the drafts' alone are tested.
    llm = LLM(str(ensure_tiny_model()), **ENGINE, speculative_config=_spec(3), enable_prefix_caching=False)
    driver, step, state = llm._driver, llm.engine.step, llm.engine.state
    params = SamplingParams(temperature=0.7, top_k=5, logprobs=2, max_tokens=12, seed=1)
    for i, prompt in enumerate(PROMPTS):
        driver.add_request(str(i), prompt, params, 12)
    driver.add_request("p", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, presence_penalty=0.5), 12)
    features = SamplerFeatures(penalties=True, filtering=True, random=True, logprobs=True)
    drafted = 0
    while driver.has_work():
        driver._fill_slots()
        resident = dict(driver.rank.asked)
        with host_reads_forbidden():
            plan = step.plan(features, None)
        drafted += int(state.draft_len.sum())
        shape = step.shape_for(plan.read_sizes())
        with host_reads_forbidden():
            out = step.run(plan, shape, features, None)
        for slot, event in _events(out, resident, features, state, page_bytes=0).items():
            if event.finish_reason:
                del driver._resident[slot], driver.rank.asked[slot]
                state.release_slot(slot)
                driver._free_slots.append(slot)
    assert drafted > 0


@pytest.mark.parametrize("drafts", ["ngram", "draft_model"])
def test_the_host_driver_publishes_every_accepted_token_within_the_window(small_table, drafts):
    """A 3-token window: drafts are capped by the room the reader left, and the tokens are plain decoding's (with a
    draft model: the model itself, engine/core/draft_model.py)."""
    def serve(spec: dict | None) -> dict[int, list[int]]:
        engine = Engine(EngineConfig(model=str(ensure_tiny_model()), max_num_seqs=4, max_num_batched_tokens=32,
                                     num_pages=64, page_size=8, max_model_len=96, dtype="float32",
                                     speculative_config=spec))
        if engine.step.drafter is not None:  # a draft as costly as the model would not pay: its cost taken as none
            engine.step.speculation = dataclasses.replace(engine.step.speculation, draft_ratio=0.0)
        driver = HostDriver(engine, small_table)
        requests = {s: Request(prompt=PROMPTS[s % 2], max_tokens=20, temperature=0.0, ignore_eos=True)
                    for s in range(3)}
        for slot, request in requests.items():
            small_table.publish(slot, request)
        got = {slot: [] for slot in requests}
        done: set[int] = set()
        deadline = time.monotonic() + 60
        while len(done) < len(requests) and time.monotonic() < deadline:
            driver.step()
            for slot in requests:
                out = small_table.read(slot)
                got[slot] += out.tokens
                if out.finish:
                    assert out.finish == Finish.LENGTH
                    done.add(slot)
        for slot in requests:
            small_table.free(slot)
        assert int(engine.pool.num_free) == engine.pool.usable_pages
        return got, int(engine.state.spec_counts[2])

    want, _ = serve(None)
    got, accepted = serve(_spec(4) if drafts == "ngram" else
                          {"model": str(ensure_tiny_model()), "num_speculative_tokens": 4})
    assert got == want and accepted > 0


def test_the_config_is_vllm_s_and_bad_ones_are_refused():
    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 3}').lookup_max == 5  # vLLM's default
    assert speculative_config({"num_speculative_tokens": 2, "prompt_lookup_max": 3}).lookup_min == 3
    assert speculative_config(None) is None and speculative_config("") is None
    # A draft model: named, its method implied; vLLM's older "[ngram]" model name is the ngram method.
    assert speculative_config({"model": "org/draft", "num_speculative_tokens": 4}).method == "draft_model"
    assert speculative_config({"model": "[ngram]", "num_speculative_tokens": 2}).model is None
    for bad, says in (({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                      ({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft"),
                      ({"method": "ngram", "model": "org/draft", "num_speculative_tokens": 2}, "name a draft model"),
                      ({"model": "org/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "ngram's"),
                      ({"model": "org/draft", "num_speculative_tokens": 2, "quantization": "int3"}, "quantization"),
                      ({"num_speculative_tokens": 2, "draft": 1}, "draft"),
                      ({"method": "ngram"}, "num_speculative_tokens"),
                      ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "at least"),
                      ("[1]", "JSON object"), ("{", "JSON object")):
        with pytest.raises(ValueError, match=says):
            speculative_config(bad)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0}).validate()


def test_sampling_features_beside_drafts_give_plain_decoding_s_tokens(plain, speculating):
    """min_tokens holds stops back per row (each row's own token index), prompt logprobs are scored by slots that
    do not draft yet, logit biases apply to every row: all as without drafts."""
    llm = speculating[5]
    stops = [r[2] for r in _tokens(plain, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8))]
    for params in (SamplingParams(temperature=0, max_tokens=20, min_tokens=10, stop_token_ids=stops),
                   SamplingParams(temperature=0.5, max_tokens=20, min_tokens=6, stop_token_ids=stops, seed=4),
                   SamplingParams(temperature=0, max_tokens=20, logit_bias={602: 0.01})):
        assert _tokens(llm, PROMPTS[:2], params) == _tokens(plain, PROMPTS[:2], params)
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=2)
    want, got = plain.generate(PROMPTS[:2], params), llm.generate(PROMPTS[:2], params)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids and len(b.prompt_logprobs) == len(a.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_drafts_pay_by_the_step_cost_fit_and_a_slot_whose_drafts_fail_stops_then_retries():
    """Latency-sensitive slots draft while their acceptance beats b * N / (a + bT), N the latency-sensitive slots
    that may draft, best-effort ones with N every slot sampling; a slot below stops drafting and climbs back to a
    retry."""
    from blink.engine.core.policy import StepCost, policy_named

    state = Slots(4, max_len=64, max_pages=8, vocab_size=8, device=torch.device("cpu"))
    state.service_class.copy_(torch.tensor([0, 1, 1, 1]))  # one latency-sensitive, three best-effort
    state.seq_len.fill_(10)
    state.num_computed.fill_(9)
    cost = StepCost(torch.device("cpu"))
    cost.fit.copy_(torch.tensor([0.010, 0.002], dtype=torch.float64))  # 10 ms a step + 2 ms a token
    take = torch.ones(4, dtype=torch.int64)
    spec = Speculation(4, 1, 2)
    able = torch.ones(4, dtype=torch.bool)
    need = spec.threshold(state, policy_named("slo"), cost, take, able)
    per_draft = 0.002 / (0.010 + 0.002 * 4)
    assert need[0] == pytest.approx(max(per_draft, 0.15)) and need[1] == pytest.approx(4 * per_draft)
    assert spec.threshold(state, policy_named("fcfs"), cost, take, able)[0] == pytest.approx(4 * per_draft)  # classless
    state.service_class[1] = 0  # two latency-sensitive slots drafting: each pays for the other's drafts too
    assert spec.threshold(state, policy_named("slo"), cost, take, able)[0] == pytest.approx(2 * per_draft)

    llm = LLM(str(ensure_tiny_model()), **ENGINE, speculative_config=_spec(4))
    driver, state = llm._driver, llm.engine.state
    # A fit of the steps' cost that the machine's load cannot move: a draft token costs 2% of a step.
    driver.rank.cost_model.observe = lambda *timed: None
    llm.engine.step.cost.fit.copy_(torch.tensor([0.010, 0.0002], dtype=torch.float64))
    driver.add_request("0", PROMPTS[0], SamplingParams(temperature=0, max_tokens=60), 60)
    driver.step()
    state.spec_rate[0] = 0.0  # as after drafts that all failed
    drafting = []
    while driver.has_work():
        driver.step()
        drafting.append(bool(state.spec_counts[0] > sum(drafting)))
    assert drafting[0] is False and any(drafting)  # it stopped, then retried once its rate climbed back


@pytest.mark.parametrize("kernel", ["torch", "cpp", "triton"])
def test_a_slot_drafts_as_deep_as_its_rate_to_the_power_of_the_position_pays(kernel):
    """The j-th draft token is kept only if the ones before it were, about rate**j of the time, and costs what the
    fit says a draft token costs (here 0.3 of a token, five slots drafting): rate 0.7 drafts 3 (0.7**3 = 0.34), 0.5
    one, 0.25 none, 0.9 and 1.0 all K (6)."""
    from blink.engine.core.policy import StepCost, policy_named
    from blink.engine.kernels import cpu_draft, draft

    if kernel == "cpp":
        from tests.support.cpu_kernels import cpu_kernels_or_skip
        cpu_kernels_or_skip()
    S, K = 5, 6
    state = Slots(S, 64, 8, 16, torch.device("cpu"))
    state.tokens[:, :13] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3], dtype=torch.int32)
    state.seq_len.fill_(13)
    state.prompt_len.fill_(4)
    state.num_computed.fill_(12)
    state.max_tokens.fill_(100)
    state.spec_rate.copy_(torch.tensor([1.0, 0.9, 0.7, 0.5, 0.25])[:, None].expand_as(state.spec_rate))
    cost = StepCost(torch.device("cpu"))
    cost.values[:2] = torch.tensor([0.035, 0.003], dtype=torch.float64)  # 5 * 0.003 / (0.035 + 5 * 0.003) = 0.3
    take = torch.ones(S, dtype=torch.int64)
    pool = SimpleNamespace(page_size=8, num_free=torch.tensor(100))
    speculation = Speculation(K, 1, 3)
    plan = {"torch": speculation.draft, "cpp": partial(cpu_draft.draft, speculation),
            "triton": partial(draft.draft, speculation)}[kernel]
    k = plan(state, pool, policy_named("fcfs"), cost, take, torch.ones(S, dtype=torch.bool), torch.arange(S),
             take.sum() + S * K)
    assert k.tolist() == [6, 6, 3, 1, 0]


@pytest.mark.slow
def test_the_default_model_accepts_drafts_on_a_grounded_answer_with_plain_decoding_s_text():
    """The real default checkpoint (SmolLM2-135M-Instruct), float32: an answer that copies its input accepts drafts
    and is plain decoding's, token for token."""
    prompt = ("<|im_start|>user\nRepeat this sentence exactly: The quick brown fox jumps over the lazy dog near the "
              "river bank.<|im_end|>\n<|im_start|>assistant\n")
    kw = dict(dtype="float32", max_num_seqs=2, max_model_len=256, num_pages=40)
    params = SamplingParams(temperature=0, max_tokens=24)
    want = LLM(**kw).generate([prompt], params)[0].token_ids
    llm = LLM(**kw, speculative_config=_spec(4, 2, 4))
    assert llm.generate([prompt], params)[0].token_ids == want
    assert int(llm.engine.state.spec_counts[2]) > 0


def test_on_the_cpu_runs_attend_as_decodes_so_bfloat16_greedy_text_is_plain_decoding_s_too():
    """The CPU's kernels take a run with drafts as decode rows (one query a row), the path plain decoding's tokens
    come from: bfloat16's rounding is the same, so near-ties break the same way."""
    options = {**ENGINE, "dtype": "bfloat16"}
    params = SamplingParams(temperature=0, max_tokens=24)
    want = _tokens(LLM(str(ensure_tiny_model()), **options), PROMPTS, params)
    llm = LLM(str(ensure_tiny_model()), **options, speculative_config=_spec(3))
    assert llm.engine.step.speculation.decode_runs
    assert _tokens(llm, PROMPTS, params) == want
    assert int(llm.engine.state.spec_counts[2]) > 0
