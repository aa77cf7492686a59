"""The step's contract: no host sync inside plan() and run(); page bookkeeping stays exact."""

from __future__ import annotations

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.core import scheduler
from blink.engine.core.kv_cache import PagePool
from blink.engine.core.sampler import SamplerFeatures
from blink.engine.drive.host import _events
from blink.engine.drive.offline import OfflineDriver
from blink.engine.model.config import ModelConfig, RopeScaling
from tests.support.host_reads import host_reads_forbidden


def test_plan_and_run_never_read_tensors_on_the_host(checkpoint):
    llm = LLM(str(checkpoint("qwen3")), max_num_seqs=4, max_num_batched_tokens=32, num_pages=40, page_size=8,
              max_model_len=64)
    driver: OfflineDriver = llm._driver
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.01, repetition_penalty=1.1,
                            frequency_penalty=0.1, logprobs=2, max_tokens=6)
    for i, n in enumerate((30, 3, 50)):
        driver.add_request(str(i), list(range(1, n + 1)), params, 6)
    features = SamplerFeatures(penalties=True, filtering=True, random=True, logprobs=True)
    step = llm.engine.step
    steps, cached = 0, 0
    while driver.has_work():
        if steps == 4:  # a prompt starting with pages the others computed: the prefix cache's lookup, in the step
            driver.add_request("3", list(range(1, 41)), params, 6)
        driver._fill_slots()
        resident = dict(driver.rank.asked)
        with host_reads_forbidden():
            plan = step.plan(features, llm.engine.mirror)
        shape = step.shape_for(plan.read_sizes())  # the one read the host loop is allowed
        with host_reads_forbidden():
            out = step.run(plan, shape, features, llm.engine.mirror)
        for slot, event in _events(out, resident, features, llm.engine.state, page_bytes=0).items():
            if event.finish_reason:
                cached += event.stats.cached_tokens
                del driver._resident[slot], driver.rank.asked[slot]
                driver.state.release_slot(slot)
                driver._free_slots.append(slot)
        steps += 1
    assert steps > 6 and cached > 0  # chunked prefill, then decodes; a prefix found cached


def _tiny_config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=10, hidden_size=8,
                       intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6,
                       rope_theta=1e4, rope_scaling=RopeScaling(), max_position_embeddings=64,
                       tie_word_embeddings=True, attention_bias=False, o_proj_bias=False, qk_norm=False,
                       sliding_window=None, dtype=torch.float32)


def test_pages_are_handed_out_once_and_all_come_back():
    pool = PagePool(_tiny_config(), num_pages=20, page_size=4, device=torch.device("cpu"))
    table = torch.zeros(3, 8 + 1, dtype=torch.int64)
    held = torch.zeros(3, dtype=torch.int64)
    pool.allocate(torch.tensor([3, 0, 5]), table, held, max_new=6)
    pool.allocate(torch.tensor([1, 2, 0]), table, held, max_new=6)
    assert held.tolist() == [4, 2, 5] and int(pool.num_free) == 19 - 11
    given = torch.cat([table[s, : held[s]] for s in range(3)])
    assert len(set(given.tolist())) == 11 and 0 not in given.tolist()

    pool.release(torch.tensor([True, False, True]), table, held)
    assert held.tolist() == [0, 2, 0] and int(pool.num_free) == 17
    pool.release(torch.tensor([False, True, False]), table, held)
    free = pool.free.stack[: int(pool.num_free)].tolist()
    assert sorted(free) == list(range(1, 20))
    assert (table[:, :-1] == 0).all()  # the last column is trash


@pytest.mark.gpu
def test_cuda_greedy_matches_cpu(checkpoint):
    device = "cuda"
    model_dir = str(checkpoint("llama3-rope"))
    prompts = [list(range(1, n)) for n in (5, 20, 45)]
    params = SamplingParams(temperature=0, max_tokens=12)
    on_cpu = LLM(model_dir, device="cpu", num_pages=64).generate(prompts, params)
    on_gpu = LLM(model_dir, device=device, num_pages=64).generate(prompts, params)
    assert [o.token_ids for o in on_gpu] == [o.token_ids for o in on_cpu]


def test_compiled_bookkeeping_gives_the_eager_steps_tokens(checkpoint):
    """`compile_bookkeeping` (Inductor, as users run it): prompts of different lengths, more than the slots, greedy
    and seeded with penalties, so the plan and the commit meet several buckets (a static compile, then a symbolic
    one); the same tokens and logprobs as the eager step."""
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 9, 17, 2, 30)]
    params = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.8, seed=5, top_k=8, repetition_penalty=1.2, max_tokens=9,
                             ignore_eos=True)]
    shape = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=40, page_size=8, max_model_len=64)
    outputs = []
    for compiled in (False, True):
        llm = LLM(str(checkpoint("qwen3")), compile_bookkeeping=compiled, **shape)
        assert (llm.engine.step.planner is not scheduler.plan) == compiled
        outputs.append([(o.token_ids, o.logprobs) for p in params for o in llm.generate(prompts, p)])
    assert outputs[0] == outputs[1]


def test_compiled_bookkeeping_without_a_cpp_compiler_is_refused_at_start(checkpoint, monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", ("no-such-c++-compiler",))
    with pytest.raises(ValueError, match="compile_bookkeeping on the CPU needs a C\\+\\+ compiler"):
        LLM(str(checkpoint("qwen3")), compile_bookkeeping=True, max_num_seqs=4, max_num_batched_tokens=32,
            num_pages=40, page_size=8, max_model_len=64)
