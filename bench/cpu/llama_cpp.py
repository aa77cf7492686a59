"""llama.cpp as a CPU baseline, from the source pip downloads: `llama-cpp-python`'s source distribution carries
llama.cpp whole (vendor/llama.cpp): its `llama-bench`, `llama-batched-bench`, `llama-quantize`, `llama-perplexity` and
`llama-server` (without its web UI, curl or OpenSSL: nothing is downloaded at build time), built here with cmake, and
its `convert_hf_to_gguf.py`, which turns the benchmark's checkpoint into GGUF files of the same weights.

Built once into Blink's cache directory (`~/.cache/blink/llama.cpp-VERSION` by default); a machine without a compiler,
cmake or the package index gets a `Missing` that says which, and the benchmark runs without this baseline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from blink.shared.model_cache import cache_root

TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-perplexity", "llama-server")


class Missing(RuntimeError):
    """llama.cpp cannot be had on this machine; the message says why."""


@dataclass(frozen=True)
class LlamaCpp:
    source: Path  # vendor/llama.cpp of the unpacked distribution
    version: str

    @property
    def bin(self) -> Path:
        return self.source / "build" / "bin"

    def gguf(self, model_dir: Path, dtype: str, out_dir: Path) -> Path:
        """The checkpoint converted by llama.cpp's own converter (`f32` or `bf16`); cached beside the others."""
        out = out_dir / f"{model_dir.name}-{dtype}.gguf"
        if not out.is_file():
            # The benchmark's tokenizer was trained here, so the converter cannot name its pre-tokenizer; llama.cpp's
            # default one is declared (the benchmarks feed token ids and never tokenize). It has no tokenizer.model,
            # which the converter imports sentencepiece to look for first: said absent without that import.
            script = ("import sys; sys.path[:0] = [sys.argv.pop(1), sys.argv.pop(1)]; import conversion.base as b; "
                      "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'\n"
                      "def absent(self): raise FileNotFoundError('tokenizer.model')\n"
                      "b.TextModel._create_vocab_sentencepiece = absent\n"
                      "import convert_hf_to_gguf as c; c.main()")
            _run([sys.executable, "-c", script, str(self.source), str(self.source / "gguf-py"), str(model_dir),
                  "--outtype", dtype, "--outfile", str(out)], "converting the checkpoint to GGUF")
        return out

    def quantized(self, model: Path, kind: str, out_dir: Path) -> Path:
        """`model` in another of llama.cpp's types (Q8_0, Q4_0, ...) by its own llama-quantize; cached beside it. From
        an already quantized file (--allow-requantize) the result holds that file's values, up to the new type."""
        out = out_dir / f"{model.stem}-{kind}.gguf"
        if not out.is_file():
            _run([str(self.bin / "llama-quantize"), "--allow-requantize", str(model), str(out), kind],
                 f"llama-quantize {kind}")
        return out

    def perplexity(self, model: Path, text: Path, context: int, chunks: int, threads: int) -> float:
        """llama-perplexity's final estimate over the first `chunks` windows of `context` tokens of `text` (each
        scored on its second half, as llama.cpp does)."""
        out = _run([str(self.bin / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(context), "-b",
                    str(context), "--chunks", str(chunks), "-t", str(threads)], "llama-perplexity")
        match = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
        if match is None:
            raise Missing(f"llama-perplexity printed no final estimate: {out[-600:]}")
        return float(match.group(1))

    def decode_ms(self, model: Path, context: int, new_tokens: int, threads: int) -> float:
        """Batch-1 decode: llama-bench's token generation after `context` tokens, ms per token."""
        out = _run([str(self.bin / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(new_tokens), "-d",
                    str(context), "-r", "1", "-t", str(threads), "-o", "jsonl"], "llama-bench")
        row = next(json.loads(line) for line in out.splitlines() if line.startswith("{"))
        return 1000.0 / float(row["avg_ts"])

    def batched_tokens_per_s(self, model: Path, batch: int, context: int, new_tokens: int, threads: int) -> float:
        """llama-batched-bench's generation speed for `batch` sequences of `context` prompt tokens each."""
        out = _run([str(self.bin / "llama-batched-bench"), "-m", str(model), "-c", str(batch * (context + new_tokens)),
                    "-npp", str(context), "-ntg", str(new_tokens), "-npl", str(batch), "-t", str(threads),
                    "--output-format", "jsonl"], "llama-batched-bench")
        row = next(json.loads(line) for line in out.splitlines() if line.startswith("{") and "speed_tg" in line)
        return float(row["speed_tg"])

    def server_command(self, model: Path, port: int, slots: int, context: int, threads: int) -> list[str]:
        """llama-server on `model` with `slots` parallel sequences (-np) of `context` tokens each, on 127.0.0.1."""
        return [str(self.bin / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(slots), "-c", str(slots * context), "-t", str(threads), "-tb", str(threads), "--no-webui"]


def ensure(cache: Path | None = None) -> LlamaCpp:
    """llama.cpp's benchmarks built from the newest `llama-cpp-python` source distribution pip finds."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise Missing(f"building llama.cpp needs {tool} on the PATH")
    cache = cache or cache_root()
    downloads = cache / "downloads"
    archives = sorted(downloads.glob("llama_cpp_python-*.tar.gz")) if downloads.is_dir() else []
    if not archives:
        downloads.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "llama-cpp-python", "--no-binary", ":all:", "--no-deps",
              "-d", str(downloads)], "downloading llama-cpp-python's source distribution")
        archives = sorted(downloads.glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise Missing("pip found no llama-cpp-python source distribution")
    archive = archives[-1]
    version = archive.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    root = cache / f"llama.cpp-{version}"
    source = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not source.is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    llama = LlamaCpp(source, version)
    if not all((llama.bin / tool).is_file() for tool in TOOLS):
        _run(["cmake", "-S", str(source), "-B", str(source / "build"), "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF"],
             "configuring llama.cpp")
        _run(["cmake", "--build", str(source / "build"), "-j", str(os.cpu_count() or 1), "--target", *TOOLS],
             "building llama.cpp (minutes)")
    return llama


def _run(cmd: list[str], what: str) -> str:
    print(f"  {what}...", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise Missing(f"{what} failed ({done.returncode}): {(done.stderr or done.stdout)[-600:]}")
    return done.stdout + done.stderr
