"""`blink bench quality`: what quantizing costs in quality, per format, on a real model (the CPU): perplexity on a
held text and greedy agreement with the float model, for Blink's formats, and llama.cpp's perplexity on the same
GGUF files.

The model is a GGUF file (`default`: SmolLM2-135M-Instruct, stored in Q4_1). The float reference is that file
dequantized (what `blink serve --model FILE.gguf` runs). Blink's formats: `int8` and `int4` (quantized on load from
the float weights), `fp8` (E4M3 per output channel, on the CPU run dequantized: the weights' rounding, not the GPU's
FP8 activations), and `gguf:TYPE`, the file's own blocks run as stored (`--quantization gguf`), for the file itself
and for copies llama.cpp's own llama-quantize makes of it (Q8_0, Q4_0 by default: from a 4-bit file these hold its
values again, so they differ from the reference by their own rounding only). llama.cpp's `llama-perplexity` scores
the same files on the same text.

Perplexity as llama-perplexity computes it: the text's tokens in windows of --context, each scored on its second half
(a token's log-probability given those before it in the window), the first token of a window replaced by BOS where
the vocabulary adds one. Greedy agreement: --prompts windows of 64 tokens from the text's end (past the scored
windows where it is long enough), --new-tokens greedy tokens each; the share of tokens equal to the float model's up
to the first difference, and the prompts that match it whole. Prints, saves JSON, asserts nothing.

    blink bench quality                          # the default model, about 5 minutes on 2 cores
    blink bench quality --text FILE --chunks 32  # another held text
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from blink.bench.cpu import llama_cpp
from blink.bench.lib.machine import blink_source, machine, save

HELD_TEXT = "docs/speculative.md"  # of llama.cpp's source (bench/cpu/llama_cpp.py), prose, about 5,500 tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="`default` (Blink's default model) or a .gguf file")
    p.add_argument("--text", type=Path, help=f"the held text (default: llama.cpp's {HELD_TEXT})")
    p.add_argument("--context", type=int, default=512, help="tokens a perplexity window holds")
    p.add_argument("--chunks", type=int, default=10, help="perplexity windows at most")
    p.add_argument("--requantize", default="Q8_0,Q4_0", help="llama.cpp types the file is copied into, each run "
                   "as stored by both (empty: none)")
    p.add_argument("--prompts", type=int, default=8, help="greedy prompts")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--no-llama-cpp", action="store_true", help="Blink only (its text then must be given)")
    p.add_argument("--result-dir", type=Path, default=Path("."))


def windows(tokens: list[int], context: int, chunks: int, bos: int | None) -> list[list[int]]:
    out = [tokens[i:i + context] for i in range(0, len(tokens) - context + 1, context)][:chunks]
    return [[bos, *w[1:]] if bos is not None else w for w in out]


def perplexity(llm, chunks: list[list[int]]) -> float:
    """exp of the mean negative log-probability of each window's second half (llama-perplexity's scoring)."""
    from blink.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    total, count = 0.0, 0
    for out, chunk in zip(llm.generate(chunks, params), chunks, strict=True):
        first = len(chunk) // 2
        for position in range(first + 1, len(chunk)):
            total -= out.prompt_logprobs[position][chunk[position]].logprob
            count += 1
    return math.exp(total / count)


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from blink.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    prefixes = []
    for a, b in zip(reference, other, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(same)
    tokens = sum(len(a) for a in reference)
    return {"prefix_share": sum(prefixes) / tokens, "whole_prompts": sum(p == len(a) for p, a in
                                                                        zip(prefixes, reference, strict=True)),
            "prefixes": prefixes}


def run(args: argparse.Namespace) -> None:
    from gguf import GGUFReader

    from blink.engine import LLM
    from blink.shared.checkpoints import default_model

    native = default_model.gguf_path() if args.model == "default" else Path(args.model)
    llama = None if args.no_llama_cpp else llama_cpp.ensure()
    text = args.text or (llama.source / HELD_TEXT if llama else None)
    if text is None:
        raise SystemExit("--no-llama-cpp: name the held text with --text")
    files = {f"gguf:{stored_type(native)}": native}
    for kind in filter(None, (k.strip() for k in args.requantize.split(","))):
        if llama is not None:
            files[f"gguf:{kind}"] = llama.quantized(native, kind, native.parent)
    meta = GGUFReader(native).fields
    add_bos = bool(meta["tokenizer.ggml.add_bos_token"].contents()) if "tokenizer.ggml.add_bos_token" in meta else False
    bos = meta["tokenizer.ggml.bos_token_id"].contents() if add_bos else None

    formats = {"float32": (native, None), "int8": (native, "int8"), "int4": (native, "int4"), "fp8": (native, "fp8")}
    formats |= {name: (path, "gguf") for name, path in files.items()}
    options = dict(device="cpu", dtype="float32", max_model_len=args.context + args.new_tokens + 64,
                   max_num_seqs=max(args.prompts, 4), num_pages=(args.context // 16 + 8) * max(args.prompts, 4))
    reference = LLM(str(native), **options)
    tokens = reference.engine.tokenizer.encode(text.read_text())
    chunks = windows(tokens, args.context, args.chunks, bos)
    if not chunks:
        raise SystemExit(f"{text}: {len(tokens)} tokens, fewer than one window of {args.context}")
    tail = tokens[len(chunks) * args.context:] if len(tokens) - len(chunks) * args.context >= 64 * args.prompts \
        else tokens
    prompts = [tail[i * 64:(i + 1) * 64] for i in range(args.prompts)]
    expected = greedy(reference, prompts, args.new_tokens)
    del reference
    results: dict[str, dict] = {}
    for name, (path, method) in formats.items():
        start = time.perf_counter()
        llm = LLM(str(path), quantization=method, **options)
        results[name] = {"file": path.name, "quantization": method, "blink_perplexity": perplexity(llm, chunks),
                         "greedy": agreement(expected, greedy(llm, prompts, args.new_tokens))}
        del llm
        if llama is not None and method == "gguf":
            results[name]["llama_cpp_perplexity"] = llama.perplexity(path, text, args.context, len(chunks),
                                                                     _threads())
        results[name]["seconds"] = time.perf_counter() - start
        print(f"  {name} done", flush=True)
    report(results)
    result = {"machine": machine() | {"torch_threads": _threads()}, "blink": blink_source(),
              "model": native.name, "text": {"file": str(text), "tokens": len(tokens), "windows": len(chunks),
                                             "context": args.context, "bos": bos},
              "greedy": {"prompts": args.prompts, "prompt_tokens": 64, "new_tokens": args.new_tokens},
              "llama_cpp": {"version": llama.version} if llama else {"left_out": "--no-llama-cpp"},
              "formats": results}
    print(f"\nsaved {save('quality', result, args.result_dir)}")


def stored_type(path: Path) -> str:
    """The type most of a GGUF file's matrices are stored in."""
    from collections import Counter

    from gguf import GGUFReader

    kinds = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) > 1)
    return kinds.most_common(1)[0][0]


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def report(results: dict[str, dict]) -> None:
    base = results["float32"]["blink_perplexity"]
    print(f"\n{'format':<12} {'file':<44} {'Blink PPL':>10} {'vs float':>9} {'llama.cpp PPL':>14} {'greedy':>8}")
    for name, r in results.items():
        theirs = r.get("llama_cpp_perplexity")
        print(f"{name:<12} {r['file']:<44} {r['blink_perplexity']:10.4f} {r['blink_perplexity'] / base - 1:+9.2%} "
              f"{f'{theirs:.4f}' if theirs else '-':>14} {r['greedy']['prefix_share']:8.1%}")
