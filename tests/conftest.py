"""Shared fixtures: small random checkpoints written by transformers itself, and the default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter; it must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite compares greedy text across batchings, processes and machines, so it runs float32 wherever `--dtype
# auto` would pick bfloat16 (whose rounding makes a greedy token depend on the batch's shape): the services it
# starts read BLINK_DTYPE, the engines it builds see no native bfloat16. test_loading checks auto's choice itself.
os.environ.setdefault("BLINK_DTYPE", "float32")


@pytest.fixture(scope="session", autouse=True)
def _float32_engines():
    from blink.engine import device

    has_bf16, device.cpu_has_bf16 = device.cpu_has_bf16, lambda: False
    yield
    device.cpu_has_bf16 = has_bf16

def _rdma_missing() -> str | None:
    try:
        from blink.shared.rdma import RdmaUnavailable, devices
    except ImportError:
        return "needs pyverbs (pip install 'blink-serve[rdma]')"
    try:
        return None if devices() else "needs an RDMA device (ibv_devices lists none)"
    except RdmaUnavailable as e:
        return f"needs an RDMA device: {e}"


def pytest_collection_modifyitems(config, items):
    """A `gpu` or `rdma` test skips, saying why, on a machine without what it needs; no test spells that out."""
    missing = {"gpu": None if torch.cuda.is_available() else "needs a CUDA device", "rdma": None}
    if any("rdma" in item.keywords for item in items):
        missing["rdma"] = _rdma_missing()
    for item in items:
        for marker, why in missing.items():
            if why and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))


CHECKPOINT_KINDS = ["llama-gqa", "llama3-rope", "mistral", "qwen2", "qwen3", "llama-tied", "llama-bias",
                    "qwen3-moe", "qwen3-moe-top1", "mixtral", "qwen2-moe"]


@pytest.fixture(scope="session", autouse=True)
def _blink_cache(tmp_path_factory):
    """Keeps what the tests fetch and generate out of the user's cache, and serves the tiny random model wherever a
    test names no model (BLINK_MODEL): the real default is tested on its own (test_default_model.py)."""
    from blink.engine.model.tiny_model import ensure_tiny_model

    os.environ.setdefault("BLINK_CACHE_DIR", str(tmp_path_factory.mktemp("blink-cache")))
    os.environ.setdefault("BLINK_MODEL", str(ensure_tiny_model()))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from blink.engine.model.tiny_model import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer().save(str(path / "tokenizer.json"))
    return path


def build_checkpoint(kind: str, target: Path, tokenizer_dir: Path, dtype: str = "float32",
                     sharded: bool = False) -> Path:
    """Writes a random checkpoint of the given kind with transformers' own save_pretrained."""
    import shutil

    import torch
    import transformers as tf

    vocab = 1174
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.15, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    configs = {
        "llama-gqa": lambda: tf.LlamaConfig(**common, tie_word_embeddings=False),
        "llama3-rope": lambda: tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}, rope_theta=500000.0),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=24),
        "qwen2": lambda: tf.Qwen2Config(**common, tie_word_embeddings=False),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
        "llama-tied": lambda: tf.LlamaConfig(**{**common, "num_key_value_heads": 4}, tie_word_embeddings=True),
        "llama-bias": lambda: tf.LlamaConfig(**common, attention_bias=True),
        # Mixtures of experts: top-2 renormalised with a dense layer mixed in; top-1 raw with tied embeddings;
        # Mixtral's top-2 of 4 with a sliding window; Qwen2-MoE's shared expert with raw weights.
        "qwen3-moe": lambda: tf.Qwen3MoeConfig(**common, head_dim=32, moe_intermediate_size=48, num_experts=4,
                                               num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                               tie_word_embeddings=False),
        "qwen3-moe-top1": lambda: tf.Qwen3MoeConfig(**common, moe_intermediate_size=48, num_experts=4,
                                                    num_experts_per_tok=1, norm_topk_prob=False,
                                                    tie_word_embeddings=True),
        "mixtral": lambda: tf.MixtralConfig(**{**common, "intermediate_size": 48}, num_local_experts=4,
                                            num_experts_per_tok=2, sliding_window=24, tie_word_embeddings=False),
        "qwen2-moe": lambda: tf.Qwen2MoeConfig(**common, moe_intermediate_size=48, shared_expert_intermediate_size=64,
                                               num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                               tie_word_embeddings=False),
    }
    config = configs[kind]()
    classes = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
               "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
               "mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM}
    torch.manual_seed(sum(map(ord, kind)))
    model = classes[config.model_type](config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # transformers starts biases at zero, which would test nothing
                param.normal_(0.0, 0.2)
    model = model.to(getattr(torch, dtype)).eval()
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, max_shard_size="200KB" if sharded else "2GB")
    shutil.copy(tokenizer_dir / "tokenizer.json", target / "tokenizer.json")
    return target


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer_dir):
    made: dict[tuple, Path] = {}

    def get(kind: str, dtype: str = "float32", sharded: bool = False) -> Path:
        key = (kind, dtype, sharded)
        if key not in made:
            made[key] = build_checkpoint(kind, tmp_path_factory.mktemp(f"{kind}-{dtype}"), tokenizer_dir,
                                         dtype, sharded)
        return made[key]

    return get


@pytest.fixture
def tiny_engine(checkpoint):
    """Builds a small engine (4 slots, 32-token budget) on the qwen3 checkpoint (or another kind), a new one per
    call."""
    from blink.engine.engine import Engine, EngineConfig

    def make(kind: str = "qwen3") -> Engine:
        return Engine(EngineConfig(model=str(checkpoint(kind)), max_num_seqs=4, max_num_batched_tokens=32,
                                   num_pages=64, page_size=8, max_model_len=96))

    return make


@pytest.fixture
def small_table():
    """A 4-slot table with a 3-token window and tiny_engine's pages, removed afterwards."""
    import uuid

    from blink.shared.slot_table import Geometry, SlotTable

    table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(4, 64, 3, page_size=8,
                                                                          max_grammar_bytes=64))
    yield table
    table.unlink()
