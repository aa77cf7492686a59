"""`blink bench serve|plot|offline|overhead|step|gpu|grain|grammar|speculation|tp|cpu|llama-server|quality|projections|
prefix|startup`: each subcommand's module declares its flags and runs it.

Only the module of the command asked for is imported: `offline` needs torch and transformers, `serve` does not.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

COMMANDS = {
    "serve": ("blink.bench.serving.serve", "load a server at request rates, print vLLM's figures, save JSON"),
    "plot": ("blink.bench.lib.plot", "P99 TTFT and TPOT against request rate, a line per result set, as PNGs"),
    "offline": ("blink.bench.engine.offline", "the engine's offline throughput against transformers' generate"),
    "overhead": ("blink.bench.serving.overhead", "HTTP streaming through `blink serve` against the offline engine"),
    "step": ("blink.bench.engine.step", "a captured step's kernels and its bytes outside the model, Llama 3 shapes"),
    "gpu": ("blink.bench.gpu.gpu", "first light for the device drive modes: checks and figures in one GPU call"),
    "grain": ("blink.bench.engine.grain", "what a best-effort prompt chunk in a step costs the decodes beside it"),
    "grammar": ("blink.bench.engine.grammar",
                "structured outputs in the host mode: constrained rows' cost a step, compile time cold and cached"),
    "speculation": ("blink.bench.engine.speculation",
                    "n-gram speculative decoding on against off: grounded and open-ended prompts, batch 1 and 8"),
    "tp": ("blink.bench.engine.tensor_parallel", "decode with the model split over N ranks against one rank"),
    "prefix": ("blink.bench.serving.prefix",
               "prefix caching on against off: TTFT of a cached prefix, multi-turn, a load"),
    "cpu": ("blink.bench.cpu.cpu", "CPU decode at batch 1 and 16 against transformers and llama.cpp, fp32 and bf16"),
    "llama-server": ("blink.bench.cpu.served",
                     "Blink served against llama.cpp's llama-server on the same GGUF, by concurrency, on the CPU"),
    "quality": ("blink.bench.cpu.quality",
                "perplexity and greedy agreement of each quantized format against the float model, and llama.cpp's"),
    "projections": ("blink.bench.engine.projections",
                    "a step's projections on the CPU in each weight form, by row count"),
    "startup": ("blink.bench.serving.startup",
                "seconds from `blink serve` to ready and to a first answer, cold and warm"),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="blink bench", description="Blink's benchmarks")
    commands = parser.add_subparsers(dest="bench_command", required=True)
    for name, (module, text) in COMMANDS.items():
        sub = commands.add_parser(name, help=text, description=text)
        if argv[:1] == [name]:
            try:
                importlib.import_module(module).add_arguments(sub)
            except ModuleNotFoundError as e:
                raise SystemExit(f"blink bench {name} needs {e.name}: pip install 'blink-serve[test]'") from None
    args = parser.parse_args(argv)
    try:
        importlib.import_module(COMMANDS[args.bench_command][0]).run(args)
    except KeyboardInterrupt as e:  # ^C, or SIGTERM (blink bench serve raises it with the signal number)
        print(f"blink bench {args.bench_command}: interrupted", file=sys.stderr)
        return 128 + (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)
    return 0
