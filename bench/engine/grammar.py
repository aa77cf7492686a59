"""`blink bench grammar`: what structured outputs cost in the host mode (issue 40), for each grammar backend.

Per backend (llguidance, xgrammar; `--backends`), in an engine of its own, and its import timed in a fresh interpreter.
Two figures. The per-token cost of constrained rows: a batch of R requests decodes T tokens with none constrained, then
with K of them following a JSON schema that cannot close within T tokens (a string of minimum length), the two
alternated round after round; milliseconds per step (median, spread), and the host's grammar work inside those steps
timed on its own (the matcher filling each constrained row's bitmask and the mask applied to the logits, the matcher
advanced by each token). And the compile time per schema, cold (a new compiler) and cached (the same spec again), on
the model's vocabulary. The model defaults to the default checkpoint (SmolLM2-135M-Instruct, a 49,152-token
vocabulary); the engine runs on the CPU unless `--device` says otherwise. Prints, saves JSON under bench/results,
asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from blink.bench.lib.machine import blink_source, machine, save
from blink.shared.grammar_backends import BACKENDS

OPEN_STRING = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100_000}},
               "required": ["text"]}  # never closes within the run: every step masks the row
SCHEMAS = {
    "two_fields": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                   "required": ["name", "age"]},
    "tool_call": {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"enum": [f"tool_{i}"]}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"]}}, "required": ["name", "parameters"]} for i in range(8)]}},
    "nested_20x20": {"type": "object", "properties": {f"k{i}": {
        "type": "object", "properties": {f"j{j}": {"type": "string", "pattern": "[a-z]{1,20}"} for j in range(20)},
        "required": [f"j{j}" for j in range(20)]} for i in range(20)}},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a checkpoint (default: the default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                   help="the structured-outputs libraries measured, each in an engine of its own")
    p.add_argument("--rows", type=int, default=4, help="requests in the batch (R)")
    p.add_argument("--constrained", type=int, nargs="+", default=[1, 4], help="of them constrained (K)")
    p.add_argument("--tokens", type=int, default=32, help="tokens each request generates (T)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--no-save", action="store_true")


class _Timed:
    """Wraps a method of `owner`, summing its seconds."""

    def __init__(self, owner: object, name: str):
        self.seconds, self.calls, inner = 0.0, 0, getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        setattr(owner, name, timed)


def run(args: argparse.Namespace) -> None:
    results = {name: _backend(args, name) for name in args.backends}
    first = results[args.backends[0]]
    result = {"benchmark": "grammar", "model": first["model"], "vocab_size": first["vocab_size"],
              "device": first["device"], "tokens": args.tokens, "repeats": args.repeats,
              "backends": results, "machine": machine(), "blink": blink_source()}
    if not args.no_save:
        print(f"saved {save('grammar', result, args.result_dir)}")


def _backend(args: argparse.Namespace, name: str) -> dict:
    """One backend's figures: its import in a fresh interpreter, the per-step cost in an engine masking with it, and
    its compiles."""
    from blink.engine import LLM, SamplingParams
    from blink.engine.core.grammar import make_backend
    from blink.shared.grammar import GrammarCompiler, GrammarSpec, StructuredOutputs

    module = "llguidance" if name == "guidance" else "xgrammar"
    imported = subprocess.run([sys.executable, "-c", f"import time; t = time.perf_counter(); import {module}; "
                               "print(time.perf_counter() - t)"], capture_output=True, text=True, check=True)
    import_s = float(imported.stdout.split()[-1])
    llm = LLM(args.model, device=args.device, max_num_seqs=args.rows, max_model_len=512, swap_space=0,
              structured_outputs_backend=name)
    engine = llm.engine
    prompts = [f"Request {i}: describe the weather in one sentence." for i in range(args.rows)]
    plain = SamplingParams(temperature=1.0, seed=1, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=args.tokens,
                                 structured_outputs=StructuredOutputs(json=OPEN_STRING))
    variants = {0: [plain] * args.rows, **{k: [constrained] * k + [plain] * (args.rows - k)
                                           for k in args.constrained}}
    for params in variants.values():  # warm: the kernels, the compile, the bitmask
        llm.generate(prompts, params)
    grammars = llm._driver.rank.grammars
    mask, advance = _Timed(grammars, "mask"), _Timed(grammars, "advance")
    step_ms: dict[int, list[float]] = {k: [] for k in variants}
    grammar_ms: dict[int, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for k, params in variants.items():  # alternated: the machine's drift falls on every variant alike
            before = mask.seconds + advance.seconds
            started = time.perf_counter()
            outs = llm.generate(prompts, params)
            took = time.perf_counter() - started
            steps = max(len(o.token_ids) for o in outs)
            step_ms[k].append(1e3 * took / steps)
            grammar_ms[k].append(1e3 * (mask.seconds + advance.seconds - before) / steps)
    rows = [{"constrained": k, "rows": args.rows, "step_ms": statistics.median(v), "step_ms_min": min(v),
             "step_ms_max": max(v), "grammar_ms_per_step": statistics.median(grammar_ms[k]),
             "over_unconstrained": statistics.median(v) / statistics.median(step_ms[0])} for k, v in step_ms.items()]
    vocab = engine.model_config.vocab_size
    print(f"{name} (import {import_s:.2f} s in a fresh interpreter): {args.rows} requests x {args.tokens} tokens, "
          f"{engine.model_name} (vocabulary {vocab}) on {engine.device}, {args.repeats} alternated repeats:")
    for r in rows:
        print(f"  {r['constrained']} constrained: {r['step_ms']:7.2f} ms a step [{r['step_ms_min']:.2f}, "
              f"{r['step_ms_max']:.2f}], grammar work {r['grammar_ms_per_step']:.3f} ms a step, "
              f"{r['over_unconstrained']:.2f}x unconstrained")
    started = time.perf_counter()
    backend = make_backend(name, engine.tokenizer.raw, vocab, list(engine.generation.eos_token_ids))
    setup_s = time.perf_counter() - started
    print(f"  the vocabulary's tables: {1e3 * setup_s:.1f} ms")
    compiles = []
    for schema_name, schema in SCHEMAS.items():
        compiler, spec = GrammarCompiler(backend, timeout_s=120), GrammarSpec.json_schema(schema)
        started = time.perf_counter()
        compiler.compile(spec)
        cold = time.perf_counter() - started
        started = time.perf_counter()
        compiler.compile(spec)
        cached = time.perf_counter() - started
        compiler.close()
        compiles.append({"schema": schema_name, "chars": len(spec.text), "cold_ms": 1e3 * cold,
                         "cached_ms": 1e3 * cached})
        print(f"  compile {schema_name} ({len(spec.text)} chars): {1e3 * cold:.1f} ms cold, {1e6 * cached:.1f} us "
              "cached")
    out = {"model": engine.model_name, "vocab_size": vocab, "device": str(engine.device), "import_s": import_s,
           "tokenizer_setup_ms": 1e3 * setup_s, "rows": rows, "compiles": compiles}
    llm.close()
    return out
