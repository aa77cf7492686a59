"""GGUF files load as the checkpoints they were made from: config, tokenizer and every tensor, for each architecture
Blink runs; what Blink cannot load correctly is refused with the reason."""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from blink.engine import LLM, SamplingParams
from blink.engine.model.config import ModelConfig, RopeScaling
from blink.shared.checkpoints.errors import CheckpointError
from blink.shared.checkpoints.source import resolve
from blink.shared.model_cache import cache_root
from blink.shared.tokenizer import Tokenizer
from tests.support.gguf_files import write_gguf, write_sentencepiece_gguf

# Not qwen3-moe: its dense layer has no place in llama.cpp's qwen3moe.
KINDS = ["llama-gqa", "llama-tied", "llama-bias", "mistral", "qwen2", "qwen3", "qwen3-moe-top1", "qwen2-moe", "mixtral"]
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors |= load_file(str(file))
    return tensors


@pytest.mark.parametrize("kind", KINDS)
def test_a_gguf_file_converts_to_the_checkpoint_it_was_made_from(checkpoint, tmp_path, kind):
    original = checkpoint(kind)
    converted = resolve(str(write_gguf(original, tmp_path / f"{kind}.gguf"))).path

    ours, theirs = ModelConfig.from_dir(converted), ModelConfig.from_dir(original)
    assert dataclasses.replace(ours, architecture=theirs.architecture) == theirs  # Mistral's GGUF says llama
    got, expected = _tensors(converted), _tensors(original)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    prompt = "Once upon a time"
    assert Tokenizer(converted).encode(prompt) == Tokenizer(original).encode(prompt)


def test_llama3_rope_scaling_comes_back_from_its_factors(checkpoint, tmp_path):
    path = write_gguf(checkpoint("llama-gqa"), tmp_path / "l3.gguf", llama3_rope=LLAMA3)
    assert ModelConfig.from_dir(resolve(str(path)).path).rope_scaling == RopeScaling(kind="llama3", **LLAMA3)

    odd = write_gguf(checkpoint("llama-gqa"), tmp_path / "odd.gguf",
                     llama3_rope={**LLAMA3, "original_max_position_embeddings": 32})
    with pytest.raises(CheckpointError, match="rope_freqs"):
        resolve(str(odd))


def test_a_quantized_gguf_generates_what_transformers_generates_from_it(checkpoint, tmp_path):
    """Q8_0, dequantized by the gguf package on both sides: the same greedy tokens as transformers' GGUF loading."""
    import transformers as tf

    path = write_gguf(checkpoint("llama-gqa"), tmp_path / "q8.gguf", quantize=gguf.GGMLQuantizationType.Q8_0)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = Tokenizer(resolve(str(path), weights=False).path).encode("Once upon a time")
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    out = LLM(str(path), dtype="float32", num_pages=32).generate("Once upon a time",
                                                                SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids[: len(expected)] == expected


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_reads_it(tmp_path):
    """Llama 2 and Mistral files: BPE over SentencePiece pieces, merges recovered from the scores, bytes for what no
    piece covers; the same ids as transformers' GGUF tokenizer, and text back as it went in."""
    import transformers as tf

    path = write_sentencepiece_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer(resolve(str(path), weights=False).path)
    theirs = tf.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["Once upon a time there was a fox.", "Hello world! 😀 ünïcode", "a\nb  c   d"]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"] and ids[0] == 1, text  # BOS added, as llama.cpp adds it
        assert ours.decode(ids) == text
    # As llama.cpp (and transformers' legacy Llama tokenizer): text after a special token gets the space prefix too.
    assert ours.encode("<s>fox") == [1, 1, *ours.encode("fox")[1:]]
    assert ours.decode(ours.encode("  hi")) == "  hi"


def test_each_file_is_converted_once_and_the_ingress_takes_only_the_tokenizer(checkpoint, tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0  # files no other test converts
    path = write_gguf(checkpoint("qwen3"), tmp_path / "m.gguf", quantize=q8)
    tokenizer_only = resolve(str(path), weights=False).path
    assert (tokenizer_only / "tokenizer.json").is_file() and not list(tokenizer_only.glob("*.safetensors"))
    full = resolve(str(path)).path
    assert full != tokenizer_only and list(full.glob("*.safetensors"))
    stamp = (full / "config.json").stat().st_mtime_ns
    assert resolve(str(path)).path == full and (full / "config.json").stat().st_mtime_ns == stamp
    assert resolve(str(path), weights=False).path == full  # the whole checkpoint serves the tokenizer too
    assert resolve(str(path)).name == "m"

    other = write_gguf(checkpoint("qwen2"), tmp_path / "n.gguf", quantize=q8)
    assert resolve(str(other)).path != full  # keyed by content


def _minimal_gguf(path, arch="llama", tokenizer="gpt2", pre="default", norm_dtype=np.float32):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in dict(block_count=1, context_length=64, embedding_length=8, feed_forward_length=16,
                           head_count=2, head_count_kv=2).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model(tokenizer)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=norm_dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("options", "reason"), [
    (dict(arch="phi3"), "GGUF architecture 'phi3' is not supported"),
    (dict(tokenizer="t5"), "GGUF tokenizer model 't5' is not supported"),
    (dict(pre="chatglm-bpe"), "GGUF pre-tokenizer 'chatglm-bpe' is not supported"),
    (dict(norm_dtype=np.float64), "type F64 cannot be dequantized"),
])
def test_what_cannot_load_correctly_is_refused_with_the_reason(tmp_path, options, reason):
    with pytest.raises(CheckpointError, match=reason):
        resolve(str(_minimal_gguf(tmp_path / "bad.gguf", **options)))
    assert not list((cache_root() / "gguf").glob(".staging-*"))  # nothing half-written left behind


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        resolve(str(tmp_path / "x.gguf"))
    with pytest.raises(CheckpointError, match="no such file or directory"):
        resolve(str(tmp_path / "missing"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match=r"neither a checkpoint directory nor a \.gguf file"):
        resolve(str(tmp_path / "notes.txt"))


def test_quantized_safetensors_checkpoints_are_refused_by_name(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from blink.engine.model.checkpoint import load_config

    fp8 = tmp_path / "fp8"
    shutil.copytree(checkpoint("qwen3"), fp8)
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match=r"Blink cannot load awq checkpoints yet"):  # FP8 ones: test_fp8.py
        load_config(fp8)
    # The same tensors without the config's word for it: the stored type gives it away.
    (fp8 / "config.json").write_text(json.dumps(config))
    tensors = _tensors(fp8)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    for file in fp8.glob("*.safetensors"):
        file.unlink()
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{name} is stored as F8_E4M3"):
        LLM(str(fp8), num_pages=32)



def test_blink_serve_of_a_model_it_cannot_load_exits_with_the_reason(tmp_path):
    import subprocess
    import sys

    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    done = subprocess.run([sys.executable, "-m", "blink.services.cli", "serve", "--port", "0", "--runtime-dir",
                           str(tmp_path), "--deployment", "unloadable", "--model", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "blink engine: " in done.stderr and "not a readable GGUF file" in done.stderr
    assert "Traceback" not in done.stderr
