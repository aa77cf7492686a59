"""The tiny model: deterministic, a real Hugging Face checkpoint, served through the normal path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blink.engine import LLM, SamplingParams
from blink.engine.model.tiny_model import write_tiny_model


def test_model_init_writes_the_same_checkpoint_every_time(tmp_path):
    a = write_tiny_model(tmp_path / "a")
    result = subprocess.run([sys.executable, "-m", "blink.services.cli", "model", "init", str(tmp_path / "b")],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(tmp_path / "b")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):
        assert (a / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_transformers_reads_it_and_agrees(tmp_path, arch):
    import torch
    import transformers as tf

    if arch == "llama":
        model_dir = write_tiny_model(tmp_path / "m")
    else:  # through the command line, as a user writes one
        subprocess.run([sys.executable, "-m", "blink.services.cli", "model", "init", "--arch", arch,
                        str(tmp_path / "m")], capture_output=True, text=True, check=True)
        model_dir = tmp_path / "m"
    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("Once upon a time")["input_ids"]
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()

    llm = LLM(str(model_dir), num_pages=32)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids[: len(expected)] == expected


def test_blink_generate_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "blink.services.cli", "generate", "--model", str(write_tiny_model(tmp_path / "m")),
         "Hi there", "--max-tokens", "4"], capture_output=True, text=True, check=True)
    assert '"tokens": 4' in result.stdout
