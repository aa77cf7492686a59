"""Checkpoint loading: shards, dtypes, eos from generation_config, and errors that name what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from blink.engine import LLM, SamplingParams
from blink.engine.errors import CheckpointError
from blink.engine.model.checkpoint import load_config
from tests.conftest import CHECKPOINT_KINDS


def _hf_logits(model_dir, ids, dtype, device="cpu"):
    """transformers' last-position logits, on the engine's device: 16-bit rounding differs between a GPU's and a
    CPU's kernels by more than the tolerance (seen on an H100: 0.054 on one of 1174 bfloat16 logits)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    with torch.no_grad():
        return model(torch.tensor([ids], device=device)).logits[0, -1].float()


def test_sharded_checkpoint_loads_like_a_single_file(checkpoint):
    single, sharded = checkpoint("qwen2"), checkpoint("qwen2", sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompt, params = [[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=8)
    assert LLM(str(sharded), num_pages=64).generate(prompt, params)[0].token_ids == \
        LLM(str(single), num_pages=64).generate(prompt, params)[0].token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_match_transformers_logits(checkpoint, dtype):
    model_dir = checkpoint("llama-gqa", dtype=dtype)
    ids = list(range(10, 40))
    llm = LLM(str(model_dir), num_pages=64)
    assert llm.engine.model.embed.dtype == getattr(torch, dtype)
    # The prefill's logits, then a decode step's (its attention and projections take the CPU's decode paths).
    first = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0].token_ids
    for prompt, new in ((ids, 1), (ids + first, 2)):
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=new))
        out = llm._driver.last_output
        ours = out.row_logits[(out.row_slot >= 0).nonzero()[0, 0]]
        expected = _hf_logits(model_dir, prompt, getattr(torch, dtype), llm.engine.device)
        torch.testing.assert_close(ours, expected, rtol=0.05, atol=0.05)


def test_eos_from_generation_config_stops_unless_ignored(checkpoint, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint("llama-gqa"), model_dir)
    prompt = [1, 2, 3, 4]
    greedy = LLM(str(model_dir), num_pages=64).generate([prompt], SamplingParams(temperature=0, max_tokens=6))
    eos = greedy[0].token_ids[2]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [9999, eos]}))
    llm = LLM(str(model_dir), num_pages=64)
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy[0].token_ids[: greedy[0].token_ids.index(eos) + 1]
    ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert ignored.token_ids == greedy[0].token_ids and ignored.finish_reason == "length"


def test_unknown_architecture_is_named(checkpoint, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint("llama-gqa"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="GPTNeoXForCausalLM"):
        LLM(str(model_dir))


@pytest.mark.parametrize("kind, key, value, named", [
    ("qwen3-moe", "num_local_experts", 5, "mlp.experts.4.gate_proj.weight"),  # more experts than the checkpoint has
    ("mixtral", "num_local_experts", 6, "block_sparse_moe.experts.4.w1.weight"),
    ("qwen3-moe", "num_experts_per_tok", 9, "num_experts_per_tok 9 of 4 experts"),
])
def test_an_inconsistent_moe_checkpoint_names_what_is_wrong(checkpoint, tmp_path, kind, key, value, named):
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint(kind), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config[key] = value
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=named):
        LLM(str(model_dir))


def test_missing_weights_file_is_named(checkpoint, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint("llama-gqa"), model_dir)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(str(model_dir))


def test_missing_shard_is_named(checkpoint, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint("qwen2", sharded=True), model_dir)
    victim = sorted(model_dir.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        LLM(str(model_dir))


def test_missing_tensor_is_named(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint("llama-gqa"), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(str(model_dir))


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_missing_file_is_named(checkpoint, tmp_path, name):
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint("llama-gqa"), model_dir)
    (model_dir / name).unlink()
    with pytest.raises(ValueError, match=name):
        LLM(str(model_dir))


def test_a_directory_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        LLM(str(tmp_path / "nowhere"))


def test_dtype_auto_runs_a_float32_checkpoint_in_bfloat16_where_the_cpu_has_it(monkeypatch):
    import torch

    from blink.engine import device

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for has_bf16, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(device, "cpu_has_bf16", lambda has=has_bf16: has)
        assert device.auto_dtype(torch.float32, cpu) == expected
        assert device.auto_dtype(torch.float16, cpu) == torch.float16  # a half checkpoint stays as it is
        assert device.auto_dtype(torch.float32, cuda) == torch.float32


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
def test_dummy_weights_have_the_checkpoints_shapes(kind, checkpoint):
    """--load-format dummy (vLLM's): random weights of every tensor's shape, so the model runs without them."""
    from blink.engine.model.checkpoint import load_tensors
    from blink.engine.model.dummy import dummy_tensors
    from blink.engine.model.model import checkpoint_tensor_names

    model_dir = checkpoint(kind)
    cfg = load_config(model_dir)
    names = checkpoint_tensor_names(cfg)
    real = load_tensors(model_dir, set(names), cfg.dtype)
    dummy = dummy_tensors(cfg, names, torch.device("cpu"))
    assert {n: t.shape for n, t in dummy.items()} == {n: t.shape for n, t in real.items()}
    llm = LLM(str(model_dir), load_format="dummy", num_pages=32, dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
