"""Tensor parallelism on the CPU (gloo): two ranks give one rank's tokens, which test_parity checks against
transformers, offline and behind `blink serve`; a killed rank fails the engine over like a killed engine; a model
that does not split is refused, saying why."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from blink.bench.lib.server import running_server
from blink.engine import LLM, SamplingParams
from blink.engine.engine import Engine, EngineConfig
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.engine.ranks import RankLost, Ranks, free_init_method
from blink.shared import control
from blink.shared.slot_table import SlotTable
from tests.support.deployment import (
    DEADLINE_S,
    MODEL,
    SLACK_S,
    decoding,
    gone,
    stream,
    wait_ready_and_serving,
    wait_until,
)

PROMPTS = [list(range(3, 8)), list(range(10, 110)), list(range(200, 240)), [7] * 17, list(range(300, 333))]
OPTIONS = dict(max_num_seqs=4, max_num_batched_tokens=64, num_pages=80, page_size=8, max_model_len=256,
               dtype="float32")


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "llama-tied", "qwen2", "qwen3-moe", "mixtral", "qwen2-moe"])
# GQA; q/k norms; tied output embedding (its vocabulary rows split); q/k/v biases; experts split (Qwen3-MoE's with
# dense layers mixed in, Mixtral's names, Qwen2-MoE's shared expert)
def test_two_ranks_give_one_ranks_tokens(kind, checkpoint):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True,
                            repetition_penalty=1.2)
    params = [greedy, seeded, greedy, seeded, greedy]
    one = LLM(str(checkpoint(kind)), **OPTIONS).generate(PROMPTS, params)
    llm = LLM(str(checkpoint(kind)), tensor_parallel_size=2, **OPTIONS)
    try:
        assert llm.engine.model.cfg.num_heads * 2 == llm.engine.model_config.num_heads  # each rank holds half
        two = llm.generate(PROMPTS, params)
        again = llm.generate(PROMPTS[:2], params[:2])  # the other rank follows call after call
    finally:
        llm.close()
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert [o.token_ids for o in again] == [o.token_ids for o in one[:2]]
    for a, b in zip(one, two, strict=True):
        for expected, got in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert got.keys() == expected.keys()
            assert all(got[t].logprob == pytest.approx(lp.logprob, abs=1e-4) for t, lp in expected.items())


def test_a_model_that_does_not_split_is_refused(checkpoint):
    from blink.engine.model.config import ModelConfig
    from blink.engine.model.parallel import Shard

    cfg = ModelConfig.from_dir(checkpoint("llama-gqa"))  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="num_attention_heads 4 does not split over 3 ranks"):
        Shard(0, 3).check(cfg)
    moe = ModelConfig.from_dir(checkpoint("qwen3-moe"))
    uneven = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, intermediate_size=50))
    with pytest.raises(ValueError, match="the experts' intermediate size 50 does not split over 4 ranks"):
        Shard(0, 4).check(uneven)


def test_the_ranks_agree_on_the_dtype_auto_picks(checkpoint):
    """`auto` depends on the CPU's flags (and, in this suite, on a patch in this process only): rank 0 resolves it
    for every rank, which would otherwise exchange tensors of different types."""
    prompts, params = PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    options = {**OPTIONS, "dtype": "auto"}
    llm = LLM(str(checkpoint("llama-gqa")), tensor_parallel_size=2, **options)
    try:
        assert llm.engine.model_config.dtype == torch.float32
        two = llm.generate(prompts, params)
    finally:
        llm.close()
    one = LLM(str(checkpoint("llama-gqa")), **options).generate(prompts, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tiny", "qwen3"])  # the tiny model (Llama, GQA); q/k norms
def test_blink_serve_over_two_ranks(kind, checkpoint, tmp_path):
    """`blink serve --tensor-parallel-size 2`: one rank's tokens; then rank 1 is killed mid-decode, and the engine
    fails over as a killed engine does (every stream ends with one error event within the deadline) and comes back
    with both ranks."""
    model = str(ensure_tiny_model() if kind == "tiny" else checkpoint(kind))
    limits = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_pages=80)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one_rank = LLM(model, dtype="float32", **limits)
    expected = [one_rank.generate([p], greedy)[0].text for p in PROMPTS[:3]]  # alone, as they are sent below
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in limits.items()] + ["--model", model,
                                                                          "--served-model-name", MODEL]
    with running_server(tmp_path, "--tensor-parallel-size", "2", "--dtype", "float32", "--watchdog-deadline",
                        str(DEADLINE_S), *flags) as server:
        def texts() -> list[str]:
            body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return [httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": p}, timeout=60)
                    .json()["choices"][0]["text"] for p in PROMPTS[:3]]

        assert texts() == expected
        info = server.request(server.control_endpoint, control.Hello(), timeout_s=5)
        assert info.drive == "host" and len(info.rank_pids) == 1
        table = SlotTable.attach(server.deployment)
        try:
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(stream, server.url, f"decode for a long time {i}", 200) for i in range(4)]
                wait_until(lambda: decoding(table, 4)(), 60, "four streams decoding")
                killed_at = time.monotonic()
                os.kill(info.rank_pids[0], signal.SIGKILL)
                results = [f.result(timeout=60) for f in futures]
        finally:
            table.close()
        for r in results:
            assert r.done and r.terminal_events == 1 and r.errors[0]["code"] == "engine_failure", r
            assert r.ended_at - killed_at < DEADLINE_S + SLACK_S
        wait_ready_and_serving(server)
        again = server.request(server.control_endpoint, control.Hello(), timeout_s=5)
        assert again.pid != info.pid and len(again.rank_pids) == 1 and again.rank_pids != info.rank_pids
        wait_until(lambda: gone(info.pid), 10, "the failed rank 0 to exit")
        assert texts() == expected


def test_the_ranks_take_the_smallest_pool_any_of_them_fits(checkpoint, monkeypatch):
    """Each rank sizes its KV pool from its own free memory: here rank 0 believes it has a terabyte, rank 1 sees
    this machine's memory at a millionth of it (two pages), and rank 0 takes rank 1's pool, as every rank must."""
    from blink.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "available_memory", lambda device: 1 << 40)  # rank 0's only: this process
    options = {k: v for k, v in OPTIONS.items() if k not in ("num_pages", "max_model_len")}
    alone = LLM(str(checkpoint("qwen3")), kv_memory_fraction=1e-6, **options)
    llm = LLM(str(checkpoint("qwen3")), tensor_parallel_size=2, kv_memory_fraction=1e-6, **options)
    try:
        assert alone.engine.pool.num_pages > 100 and llm.engine.pool.num_pages < 10
        assert llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    finally:
        llm.close()

def exit_at_once(model, engine_options, inbox) -> None:
    """A rank's life (blink.engine.ranks.RankMain) that ends before it joins the others."""
    os._exit(3)


def test_a_rank_that_dies_before_joining_fails_rank_0_at_once(checkpoint):
    """Rank 0 would wait for torch's half-hour rendezvous timeout; it gives up as soon as the rank is gone, saying
    which. (Last in this file: the abandoned rendezvous stays blocked on a daemon thread.)"""
    model = str(checkpoint("qwen3"))
    options = {**OPTIONS, "tensor_parallel_size": 2, "distributed_init_method": free_init_method()}
    ranks = Ranks(model, options, exit_at_once)
    started = time.monotonic()
    try:
        with pytest.raises(RankLost, match=r"rank 1 \(pid \d+\) exited with code 3 before the ranks met"):
            Engine(EngineConfig(model=model, **options), ranks.lost)
    finally:
        ranks.close()
    assert time.monotonic() - started < 60
