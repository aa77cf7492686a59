"""The tiny model, for tests and benchmarks that need speed: a small random-weight Llama with a byte-level BPE
tokenizer trained here (the default model is a real one: blink.shared.checkpoints.default_model).

Written deterministically on first use into the user's cache directory and loaded through the same path
as any Hugging Face checkpoint. `blink model init DIR` writes one anywhere; `--arch qwen3-moe` writes a small
random mixture-of-experts model (Qwen3-MoE's layout and names) instead.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from blink.shared.model_cache import tiny_model_dir

SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCH = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5)
TOKENIZER_VOCAB = 2048
# The architectures `blink model init --arch` writes: config.json's fields beyond the shared ones.
ARCHS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=64, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=192, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], attention_bias=False),
}


def ensure_tiny_model() -> Path:
    target = tiny_model_dir()
    if not (target / "model.safetensors").is_file():
        write_tiny_model(target)
    return target


def write_tiny_model(target: Path, arch: str = "llama") -> Path:
    """Writes the checkpoint (an architecture of ARCHS) into a sibling temporary directory, then renames it into
    place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        tokenizer = train_tokenizer()
        tokenizer.save(str(staging / "tokenizer.json"))
        vocab = tokenizer.get_vocab_size()
        ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
        eos = [ids["</s>"], ids["<|im_end|>"]]
        config = dict(**ARCHS[arch], vocab_size=vocab, hidden_act="silu", tie_word_embeddings=False,
                      torch_dtype="float32", bos_token_id=ids["<s>"], eos_token_id=eos[0], **ARCH)
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", {"bos_token_id": ids["<s>"], "eos_token_id": eos})
        _write_json(staging / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "chat_template": CHAT_TEMPLATE, "model_max_length": ARCH["max_position_embeddings"],
        })
        save_file(random_weights(config), str(staging / "model.safetensors"), metadata={"format": "pt"})
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def train_tokenizer() -> Tokenizer:
    corpus = resources.files("blink.engine").joinpath("assets/corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus.splitlines(), trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", bos)])
    return tokenizer


def random_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.02

    w = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": normal(hidden, hidden),
            p + "self_attn.k_proj.weight": normal(kv, hidden),
            p + "self_attn.v_proj.weight": normal(kv, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, hidden),
        }
        if "num_experts" in config:  # Qwen3-MoE: q/k norms, a router and the experts
            experts, moe_inter = config["num_experts"], config["moe_intermediate_size"]
            w |= {p + "self_attn.q_norm.weight": torch.ones(head_dim),
                  p + "self_attn.k_norm.weight": torch.ones(head_dim), p + "mlp.gate.weight": normal(experts, hidden)}
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                w[q + "gate_proj.weight"] = normal(moe_inter, hidden)
                w[q + "up_proj.weight"] = normal(moe_inter, hidden)
                w[q + "down_proj.weight"] = normal(hidden, moe_inter)
        else:
            w |= {p + "mlp.gate_proj.weight": normal(inter, hidden), p + "mlp.up_proj.weight": normal(inter, hidden),
                  p + "mlp.down_proj.weight": normal(hidden, inter)}
    w["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return w


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
