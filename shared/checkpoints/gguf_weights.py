"""A GGUF file's tensors under transformers' names, dequantized with the `gguf` package (`hf_tensors`), and its
quantized matrices repacked as they are stored (`hf_quantized`, blink.shared.checkpoints.gguf_blocks).

llama.cpp's converter permutes Llama's q and k rows (its RoPE pairs neighbouring dimensions, transformers' pairs
halves) and stacks MoE experts into one tensor per projection; both are undone here, so the result is the checkpoint
the file was made from, up to its quantization.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from blink.shared.checkpoints import gguf_blocks
from blink.shared.checkpoints.errors import CheckpointError

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
          "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
          "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# Per naming (MoeConfig.naming): the router, and each expert's gate, up and down projections.
_ROUTER = {"mixtral": "block_sparse_moe.gate", "qwen": "mlp.gate"}
_EXPERTS = {"mixtral": ("block_sparse_moe.experts.{}.w1", "block_sparse_moe.experts.{}.w3",
                        "block_sparse_moe.experts.{}.w2"),
            "qwen": ("mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj")}
_STACKED = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Kept in their own type (exact and half the size); everything else is dequantized to float32.
_KEPT = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32}


def stored_dtype(tensors: list[ReaderTensor]) -> str:
    """config.json's torch_dtype: float16 when every matrix is stored so, else float32 (dequantized)."""
    matrices = [t for t in tensors if len(t.shape) > 1]
    return "float16" if matrices and all(t.tensor_type == GGMLQuantizationType.F16 for t in matrices) else "float32"


def hf_tensors(tensors: Iterable[ReaderTensor], config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers name, array) for every tensor of the file; rope_freqs is folded into config.json instead."""
    naming = "mixtral" if config["model_type"] == "mixtral" else "qwen"
    unpermute = config["model_type"] in ("llama", "mixtral")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        if tensor.name in _GLOBAL:
            yield _GLOBAL[tensor.name], _values(tensor)
            continue
        match = _BLOCK.fullmatch(tensor.name)
        if match is None:
            raise CheckpointError(f"GGUF tensor {tensor.name!r} has no counterpart in {config['architectures'][0]}")
        layer, part, kind = match.groups()
        prefix = f"model.layers.{layer}."
        values = _values(tensor)
        if part in _STACKED:
            for expert, matrix in enumerate(values):
                yield prefix + _EXPERTS[naming][_STACKED[part]].format(expert) + ".weight", matrix
        elif part == "ffn_gate_inp":
            yield f"{prefix}{_ROUTER[naming]}.{kind}", values
        elif part in _LAYER:
            if unpermute and part in heads:
                values = _unpermute(values, heads[part])
            if part == "ffn_gate_inp_shexp":
                values = values.reshape(1, -1)  # transformers' Linear(hidden, 1)
            yield f"{prefix}{_LAYER[part]}.{kind}", values
        else:
            raise CheckpointError(f"GGUF tensor {tensor.name!r} has no counterpart in {config['architectures'][0]}")


def hf_quantized(tensors: Iterable[ReaderTensor], config: dict) -> Iterator[tuple[str, tuple[np.ndarray, ...], int]]:
    """(transformers name, (codes, scale, offset), bits) for every projection and embedding matrix stored in a type
    gguf_blocks repacks; MoE experts and routers are left to `hf_tensors`' floats."""
    unpermute = config["model_type"] in ("llama", "mixtral")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in tensors:
        name, part = _GLOBAL.get(tensor.name), None
        if name is None:
            match = _BLOCK.fullmatch(tensor.name)
            if match is None or match[2] not in _LAYER or match[2] == "ffn_gate_inp_shexp" or match[3] != "weight":
                continue
            part = match[2]
            name = f"model.layers.{match[1]}.{_LAYER[part]}.weight"
        packed = gguf_blocks.repack(tensor.tensor_type, tensor.data)
        if packed is None:
            continue
        *arrays, bits = packed
        if unpermute and part in heads:
            arrays = [_unpermute(a, heads[part]) for a in arrays]
        yield name, tuple(np.ascontiguousarray(a) for a in arrays), bits


def _values(tensor: ReaderTensor) -> np.ndarray:
    kept = _KEPT.get(tensor.tensor_type)
    if kept is not None:
        return np.ascontiguousarray(tensor.data.view(kept)).reshape(tuple(reversed(tensor.shape.tolist())))
    try:
        return np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise CheckpointError(f"GGUF tensor {tensor.name!r}: type {tensor.tensor_type.name} cannot be dequantized "
                              "by the gguf package") from None


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's permute: each head's rows interleaved pairwise back into two halves."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
