"""`blink bench cpu`: decode on the CPU at batch 1 and batch 16, Blink against transformers' `generate` and
llama.cpp (`llama-bench`, `llama-batched-bench`, on the same weights converted to GGUF: bench/cpu/llama_cpp.py), in
float32 and bfloat16, the systems alternated round after round in one sitting, with the memory floor measured in
the same sitting (this VM's read bandwidth changes from one process to the next).

Decode is what generating costs once the prompt is in: for Blink and transformers, (time to generate N + 1 tokens
- time to generate 1) / N after a `--context`-token prompt, greedy, EOS ignored; llama-bench measures the same
(token generation after `-d` context tokens), llama-batched-bench its generation speed over `--batch` sequences.
The floor is the weights' bytes over the bandwidth of a plain read (a torch sum over 1 GiB), the bound a batch-1
decode cannot beat. Prints, saves JSON under --result-dir, asserts nothing.

    blink bench cpu                    # the 125M Llama of `blink bench offline`, about 10 minutes on 2 cores
    blink bench cpu --model default    # the default model (SmolLM2-135M-Instruct); llama.cpp runs its Q4_1 GGUF
    blink bench cpu --no-llama-cpp     # without building llama.cpp

With `--model` (`default` or a .gguf file) Blink and transformers run the checkpoint the file converts to (its weights
dequantized, in each --dtypes), and llama.cpp runs the file itself, quantized, as its users do: llama.cpp reads
fewer bytes per token, and the floor printed is the dequantized weights'.

`--quantized Q8_0,Q4_1,...` (with `--model`) adds a group per llama.cpp type: the file in that type (itself, or the
copy llama.cpp's llama-quantize makes of it), run by llama.cpp and by Blink as stored (`blink-gguf`,
`--quantization gguf`), and beside them Blink quantizing the float weights on load where a type has a counterpart
(`blink-int8` by Q8_0, `blink-int4` by Q4_0); the group's floor is the file's matrices' bytes.

    blink bench cpu --model default --dtypes float32 --quantized Q8_0,Q4_1,Q4_0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from blink.bench.cpu import llama_cpp, quality
from blink.bench.engine.offline import MODEL_SHAPE, PROMPT_VOCAB, build_checkpoint, on_checkpoint, seed_everything
from blink.bench.lib.machine import blink_source, environment, machine, save

DTYPES = {"float32": "f32", "bfloat16": "bf16"}  # torch's names, and llama.cpp's


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=Path, help="where the random Llama is (built there if absent; default: a "
                   "temporary directory)")
    p.add_argument("--model", help="a real model instead of the random Llama: `default` (Blink's default model) or "
                   "a .gguf file, which llama.cpp runs natively")
    p.add_argument("--dtypes", default="float32,bfloat16", help="float32, bfloat16 or both")
    p.add_argument("--context", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per measurement")
    p.add_argument("--batch", type=int, default=16, help="the batched measurement's sequences")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds; figures are their medians")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out (no build)")
    p.add_argument("--no-transformers", action="store_true", help="leave transformers' generate out (the slowest "
                   "system; its model still counts the float weights' bytes)")
    p.add_argument("--compile-bookkeeping", action="store_true", help="also Blink with --compile-bookkeeping "
                   "(blink-compiled: one more system in the rotation)")
    p.add_argument("--reference-kernels", action="store_true", help="also Blink with the torch reference in place "
                   "of the CPU's C++ kernels (blink-torch-kernels: one more system in the rotation)")
    p.add_argument("--small-pages", action="store_true", help="also Blink with its weights and KV cache in torch's "
                   "4 KiB pages, not huge pages (BLINK_HUGE_PAGES=0; blink-4k-pages: one more system in the rotation)")
    p.add_argument("--quantized", default="", help="with --model: llama.cpp types (Q8_0, Q4_0, Q4_1, Q4_K_S...), a "
                   "group each: Blink running that GGUF as stored against llama.cpp (and int8/int4 on load)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", type=Path, default=Path("."))


def read_bandwidth() -> float:
    """Bytes per second of a plain read from memory: the best of five sums over 1 GiB."""
    data = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


# A quantized group's Blink systems besides `blink-gguf`: the type -> (name, --quantization on load).
ON_LOAD = {"Q8_0": ("blink-int8", "int8"), "Q4_0": ("blink-int4", "int4")}

# Blink besides its defaults, one more system in the rotation each: the flag that adds it -> (its name, the
# environment it starts in, engine options).
VARIANTS = {
    "compile_bookkeeping": ("blink-compiled", {}, {"compile_bookkeeping": True}),
    "reference_kernels": ("blink-torch-kernels", {"BLINK_KERNELS": "torch"}, {}),
    "small_pages": ("blink-4k-pages", {"BLINK_HUGE_PAGES": "0"}, {}),
}


class BlinkDecoder:
    def __init__(self, model_dir: Path, dtype: str, batch: int, name: str = "blink",
                 env: dict[str, str] | None = None, options: dict | None = None):
        from blink.engine import LLM, SamplingParams

        self.name = name
        with environment(**(env or {})):
            self.llm = LLM(str(model_dir), max_num_seqs=batch, max_num_batched_tokens=512, device="cpu",
                           dtype=dtype, max_model_len=1024, **(options or {}))  # a KV pool of what is measured
        self.kernels = self.llm.engine.model.kernels.name
        self.params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def generate(self, prompts: list[list[int]], n: int) -> None:
        self.llm.generate(prompts, self.params(n))


class TransformersDecoder:
    name = "transformers"

    def __init__(self, model_dir: Path, dtype: str, batch: int):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int) -> None:
        self.model.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)


def decode_seconds(system, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds per decode step: generating new_tokens more than one token, over new_tokens."""
    start = time.perf_counter()
    system.generate(prompts, 1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    system.generate(prompts, new_tokens + 1)
    return (time.perf_counter() - start - one) / new_tokens


def benchmark(args: argparse.Namespace, model_dir: Path, native: Path | None = None) -> None:
    """native: the GGUF file model_dir was converted from, which llama.cpp runs as it is; None: the random Llama."""
    source = blink_source()
    if native is None:
        build_checkpoint(model_dir, args.seed)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]  # none: the --quantized groups only
    if unknown := set(dtypes) - set(DTYPES):
        raise SystemExit(f"--dtypes: unknown {sorted(unknown)}")
    llama, llama_reason = None, "--no-llama-cpp"
    if not args.no_llama_cpp:
        try:
            llama = llama_cpp.ensure()
            ggufs = {d: native or llama.gguf(model_dir, DTYPES[d], model_dir) for d in dtypes}
        except llama_cpp.Missing as e:
            llama, llama_reason = None, str(e)
            print(f"llama.cpp left out: {e}")
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, PROMPT_VOCAB, (args.batch, args.context), generator=gen).tolist()
    systems = {d: [BlinkDecoder(model_dir, d, args.batch), TransformersDecoder(model_dir, d, args.batch)]
               for d in dtypes}
    weight_bytes = {d: sum(p.numel() for p in systems[d][1].model.parameters()) * getattr(torch, d).itemsize
                    for d in dtypes}
    if args.no_transformers:
        systems = {d: [s for s in group if not isinstance(s, TransformersDecoder)] for d, group in systems.items()}
    for flag, (name, env, options) in VARIANTS.items():
        if getattr(args, flag):
            for d in dtypes:
                systems[d].append(BlinkDecoder(model_dir, d, args.batch, name, env, options))
    for kind in filter(None, (k.strip() for k in args.quantized.split(","))):
        if native is None or llama is None:
            raise SystemExit("--quantized needs --model (a GGUF file) and llama.cpp")
        path = native if quality.stored_type(native) == kind else llama.quantized(native, kind, native.parent)
        systems[kind] = [BlinkDecoder(path, "float32", args.batch, "blink-gguf", options={"quantization": "gguf"})]
        if kind in ON_LOAD:
            name, method = ON_LOAD[kind]
            systems[kind].append(BlinkDecoder(model_dir, "float32", args.batch, name,
                                              options={"quantization": method}))
        ggufs[kind], weight_bytes[kind] = path, matrix_bytes(path)
        dtypes.append(kind)
    for d in dtypes:  # warm-up: weights in memory, first-call costs paid (compiling: every bucket measured)
        for system in systems[d]:
            system.generate(prompts[:1], 2)
            system.generate(prompts, 2)

    samples: dict[str, dict[str, dict[str, list[float]]]] = {d: {} for d in dtypes}  # dtype -> figure -> system

    def record(dtype: str, figure: str, system: str, value: float) -> None:
        samples[dtype].setdefault(figure, {}).setdefault(system, []).append(value)

    for round_ in range(args.rounds):
        for d in dtypes:
            record(d, "floor_ms_per_token", "memory", weight_bytes[d] / read_bandwidth() * 1000)
            for system in systems[d]:
                record(d, "batch1_ms_per_token", system.name, 1000 * decode_seconds(system, prompts[:1],
                                                                                    args.new_tokens))
                record(d, f"batch{args.batch}_tokens_per_s", system.name,
                       args.batch / decode_seconds(system, prompts, args.new_tokens))
            if llama is not None:
                record(d, "batch1_ms_per_token", "llama.cpp",
                       llama.decode_ms(ggufs[d], args.context, args.new_tokens, threads))
                record(d, f"batch{args.batch}_tokens_per_s", "llama.cpp",
                       llama.batched_tokens_per_s(ggufs[d], args.batch, args.context, args.new_tokens, threads))
            print(f"  round {round_} {d} done", flush=True)

    medians = {d: {fig: {s: statistics.median(v) for s, v in by.items()} for fig, by in figs.items()}
               for d, figs in samples.items()}
    report(medians, samples, args.batch)
    result = {"machine": machine() | {"torch_threads": threads}, "blink": source,
              "model": ({"gguf": native.name, "checkpoint": json.loads((model_dir / "config.json").read_text())}
                        if native else {**MODEL_SHAPE, "tie_word_embeddings": True}) | {"weight_bytes": weight_bytes},
              "workload": {"context": args.context, "new_tokens": args.new_tokens, "batch": args.batch,
                           "rounds": args.rounds, "seed": args.seed},
              "llama_cpp": {"version": llama.version} if llama else {"left_out": llama_reason},
              "blink_kernels": {s.name: s.kernels for s in systems[dtypes[0]] if isinstance(s, BlinkDecoder)},
              "samples": samples, "medians": medians}
    print(f"\nsaved {save('cpu', result, args.result_dir)}")


def matrix_bytes(path: Path) -> int:
    """Bytes of a GGUF file's matrices as stored: what a batch-1 decode reads (the embedding's lookup aside)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if len(t.shape) > 1)


def report(medians: dict, samples: dict, batch: int) -> None:
    for d, figs in medians.items():
        print(f"\n{d}: medians [min, max] of {len(samples[d]['floor_ms_per_token']['memory'])} alternated rounds")
        for fig, by in figs.items():
            print(f"  {fig}")
            for system, value in by.items():
                spread = samples[d][fig][system]
                print(f"    {system:<20} {value:9.2f}  [{min(spread):.2f}, {max(spread):.2f}]")
        one, many = figs["batch1_ms_per_token"], figs[f"batch{batch}_tokens_per_s"]
        blinks = ("blink", "blink-gguf", *(v[0] for v in ON_LOAD.values()), *(v[0] for v in VARIANTS.values()))
        for blink in (name for name in blinks if name in one):
            for other in ("transformers", "llama.cpp", "memory"):
                base = one.get(other) or figs["floor_ms_per_token"].get(other)
                if base:
                    print(f"  {blink} batch 1 / {other}: {one[blink] / base:.2f}x the time")
            for other in ("transformers", "llama.cpp"):
                if other in many:
                    print(f"  {blink} batch {batch} / {other}: {many[blink] / many[other]:.2f}x the tokens/s")


def run(args: argparse.Namespace) -> None:
    seed_everything(args.seed)
    if args.model is None:
        on_checkpoint(args.model_dir, lambda model_dir: benchmark(args, model_dir))
        return
    from blink.shared.checkpoints import default_model
    from blink.shared.checkpoints.source import resolve

    native = default_model.gguf_path() if args.model == "default" else Path(args.model)
    if native.suffix != ".gguf":
        raise SystemExit(f"--model: {args.model} is neither `default` nor a .gguf file")
    benchmark(args, resolve(str(native)).path, native)
