"""GGUF files written from the tests' random checkpoints as llama.cpp's converter writes them: its tensor names (from
the gguf package's own name map, not Blink's), Llama's q/k rows permuted, experts stacked, Llama 3's rope scaling as
per-frequency factors, and the tokenizer as metadata."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "mixtral": gguf.MODEL_ARCH.LLAMA,
         "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
         "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}
EXPERT_PARTS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj", "w1": "gate_proj",
                "w3": "up_proj", "w2": "down_proj"}


def write_gguf(checkpoint: Path, target: Path, quantize: gguf.GGMLQuantizationType | None = None,
               llama3_rope: dict | None = None) -> Path:
    """llama3_rope: Llama 3's scaling parameters, written as rope_freqs (the checkpoint's own config has none)."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = ARCHS[config["model_type"]]
    name = gguf.MODEL_ARCH_NAMES[arch]
    layers = config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(target), name)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 1e4))
    writer.add_vocab_size(config["vocab_size"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        if "norm_topk_prob" in config:
            writer.add_expert_weights_norm(config["norm_topk_prob"])
    if config.get("sliding_window") and config["model_type"] in ("mistral", "mixtral"):
        writer.add_sliding_window(config["sliding_window"])
    _add_tokenizer(writer, checkpoint)

    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors |= load_file(str(file))
    names = gguf.get_tensor_name_map(arch, layers)
    stacked: dict[str, list[np.ndarray]] = {}
    permuted = config["model_type"] in ("llama", "mistral", "mixtral")
    for hf_name, values in tensors.items():
        values = values.astype(np.float32)
        base, _, suffix = hf_name.rpartition(".")
        if ".experts." in base:  # model.layers.L.mlp.experts.E.gate_proj -> one stacked ...experts.gate_proj
            head, expert_part = base.rsplit(".", 1)
            prefix, _, expert = head.rpartition(".")
            stacked.setdefault(f"{prefix}.{EXPERT_PARTS[expert_part]}", []).append((int(expert), values))
            continue
        if permuted and base.endswith(("q_proj", "k_proj")):
            values = _permute(values, heads if base.endswith("q_proj") else kv_heads)
        if base.endswith("shared_expert_gate"):
            values = values.reshape(-1)
        _add(writer, names.get_name(base) + "." + suffix, values, quantize)
    for base, parts in stacked.items():
        matrix = np.stack([v for _, v in sorted(parts, key=lambda p: p[0])])
        gguf_base = names.get_name(base.replace("block_sparse_moe.experts", "mlp.experts"))
        _add(writer, gguf_base + ".weight", matrix, quantize)
    if llama3_rope:
        writer.add_tensor("rope_freqs.weight", _llama3_factors(head_dim, config, llama3_rope))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _add(writer: gguf.GGUFWriter, name: str, values: np.ndarray, quantize) -> None:
    if quantize is None or values.ndim < 2:
        writer.add_tensor(name, values)
        return
    writer.add_tensor(name, gguf.quants.quantize(values, quantize), raw_dtype=quantize)


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute: each head's two halves interleaved pairwise."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _llama3_factors(head_dim: int, config: dict, p: dict) -> np.ndarray:
    theta = config.get("rope_theta") or 1e4
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < p["original_max_position_embeddings"] / p["high_freq_factor"]:
            factors.append(1.0)
        elif wavelen > p["original_max_position_embeddings"] / p["low_freq_factor"]:
            factors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter, checkpoint: Path) -> None:
    model = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = {t["content"]: t["id"] for t in model["added_tokens"]} | model["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in model["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["model"]["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def write_sentencepiece_gguf(target: Path, vocab_size: int = 600) -> Path:
    """A GGUF whose tokenizer is SentencePiece BPE (tokenizer.ggml.model `llama`, as Llama 2 and Mistral files are):
    pieces trained on the tiny model's corpus, scored by merge rank as llama.cpp's converter scores them, the 256
    byte pieces, and the usual <unk>, <s>, </s>. No weights: only the tokenizer is read from it."""
    from importlib import resources

    from tokenizers import SentencePieceBPETokenizer

    corpus = resources.files("blink.engine").joinpath("assets/corpus.txt").read_text(encoding="utf-8")
    spm = SentencePieceBPETokenizer()
    spm.train_from_iterator(corpus.splitlines(), vocab_size=vocab_size, show_progress=False)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(sorted(spm.get_vocab().items(), key=lambda kv: kv[1])):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(rank))
    writer = gguf.GGUFWriter(str(target), "llama")
    for key, value in dict(block_count=1, context_length=64, embedding_length=8, feed_forward_length=16,
                           head_count=2).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
