"""`blink bench step`: what one captured decode step costs, counted rather than timed: its kernels, and the bytes
its work outside the model touches.

The device modes replay the same step whatever the batch, so every kernel of it is paid every step, a few
microseconds each in a replayed graph. This runs that step (`DeviceStep.run`, on the CPU with the Triton kernels in
Triton's interpreter) under a torch dispatch mode and counts, as blink.bench.engine.kernel_count says (a Triton
launch 1, an aten op that computes or moves data 1, a view or an `empty` 0, a projection 1), the kernels a GPU
would launch in a replay of it, by phase: one layer of the forward (the stand-in has one; a shape's count is that
times its layers), the rest of the forward (embedding, last residual add), the logits (final norm, output
projection, cast) and the bookkeeping (everything else: admission, planning, the prefix cache, penalties, sampling,
commit, the exchange with the slot table, the cost fit). The attention's key splits are chosen as on an H100
(`_as_on_a_gpu`), which the CPU would not split. Each JSON row has `kernels_per_step`, `kernels_forward_per_layer`,
`kernels_bookkeeping` (and `kernels_forward_rest`, `kernels_logits`, `kernel_ops`: per phase, per op).

Bytes: every tensor op outside the model's forward and logits, and the bytes each one reads and writes: its
tensors' sizes, except that a view moves nothing and an indexed read or write (index, index_put_, scatter_...)
touches the rows it names, not the whole tensor it indexes. The exchange kernels' bytes (admission from the table,
emission into it, the demand) are not counted: interpreted, they copy every argument, which a GPU does not; on the
device they read each slot's control words, and a prompt once, when it is admitted. The shapes that matter are the
vocabulary, the context, the slots and the token bucket; the model itself is a one-layer bfloat16 stand-in with the
real vocabulary and Llama's layer, so the counts hold for the 1B and 8B Llama 3 shapes alike, and are compared with
their weight bytes.

The step is counted as a GPU runs it (`--kernels triton`: the model's Triton kernels; the fused sampler, whose
kernels count their own passes over the logits, each pass counted as reading a row of logits). `--kernels torch`
counts the step as the CPU's torch reference runs it: the torch attention's gathers and the torch sampler.
`--requests` picks what the resident requests ask for: `greedy`, or `mixed` (half greedy, half sampling with
temperature, top-k, top-p, min-p, penalties, a logit bias and logprobs): the captured step is the same code for
both; what it costs is not. `drafting` counts a step with n-gram drafts (the engine built with DRAFTING's
`--speculative-config`): greedy slots whose output repeats their prompt, each drafting in the step counted (checked;
the captured step's kernels are the same whatever a draft's length), its bucket widened to every slot's 1 + K tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

from blink.shared.grammar import GrammarKind

SHAPES = {  # Llama 3's vocabulary, its layers; the weight bytes one decode step reads in bf16
    "llama3-1b": {"vocab": 128256, "layers": 16, "weight_bytes": 2.47e9},
    "llama3-8b": {"vocab": 128256, "layers": 32, "weight_bytes": 16.06e9},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--slots", nargs="+", type=int, default=[16, 256])
    p.add_argument("--context", type=int, default=4096, help="max_model_len")
    p.add_argument("--bucket", type=int, default=16, help="the token bucket of the step counted (decodes)")
    p.add_argument("--vocab", type=int, help="override the shape's vocabulary (a quick run)")
    p.add_argument("--kernels", choices=("triton", "torch"), default="triton",
                   help="the step as a GPU runs it (Triton kernels, the fused sampler) or as the CPU runs it")
    p.add_argument("--requests", nargs="+", choices=sorted(REQUESTS), default=["greedy", "mixed"])
    p.add_argument("--label", help="names the code measured in the saved result (e.g. the commit of a baseline)")
    p.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--no-save", action="store_true")


def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined: the CPU runs them interpreted
    from blink.bench.lib.machine import blink_source, machine, save

    rows = []
    vocabs = sorted({args.vocab or SHAPES[s]["vocab"] for s in args.shape})
    for vocab in vocabs:
        with _stand_in(vocab, args.context) as model_dir:
            for slots, requests in ((s, r) for s in args.slots for r in args.requests):
                bucket = bucket_for(requests, slots, args.bucket)
                counted = count_step(model_dir, slots, args.context, bucket, args.kernels, requests)
                for shape in args.shape:
                    if (args.vocab or SHAPES[shape]["vocab"]) != vocab:
                        continue
                    share = counted["bytes"] / SHAPES[shape]["weight_bytes"]
                    figures = kernel_figures(counted, SHAPES[shape]["layers"])
                    rows.append({"shape": shape, "vocab": vocab, "slots": slots, "context": args.context,
                                 "bucket": bucket, "kernels": args.kernels, "requests": requests,
                                 "layers": SHAPES[shape]["layers"], **figures, **counted,
                                 "weight_bytes": SHAPES[shape]["weight_bytes"], "bytes_over_weights": share})
                    print(f"{shape:10s} vocab {vocab:6d} slots {slots:4d} context {args.context:6d} bucket "
                          f"{bucket:3d} {requests:6s} ({args.kernels}): {figures['kernels_per_step']:5d} "
                          f"kernels a step = {figures['kernels_forward_per_layer']} a layer x "
                          f"{SHAPES[shape]['layers']} + {figures['kernels_forward_rest']} + "
                          f"{figures['kernels_logits']} logits + {figures['kernels_bookkeeping']} bookkeeping; "
                          f"{counted['ops']:4d} ops, {counted['bytes'] / 1e9:7.3f} GB outside the forward = "
                          f"{share:6.1%} of the weights ({counted['seconds']:.2f} s on this CPU)")
                    for name, (ops, nbytes) in list(counted["top"].items())[:5]:
                        print(f"    {nbytes / 1e9:7.3f} GB in {ops:3d} × {name}")
    result = {"benchmark": "step", "label": args.label, "machine": machine(), "blink": blink_source(), "rows": rows}
    if not args.no_save:
        print(f"saved {save('step', result, args.result_dir)}")


# What the resident requests ask for: every slot's knobs (slot -> Request keyword arguments).
REQUESTS = {
    "greedy": lambda slot: dict(temperature=0.0),
    "mixed": lambda slot: dict(temperature=0.0) if slot % 2 else dict(
        temperature=0.8, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.1, frequency_penalty=0.2,
        logprobs=5, seed=slot, logit_bias=((13, 2.0),)),
    # Greedy, held by a bias to the token its prompt repeats (random weights follow no prompt): each step's last
    # tokens are found just before them, so every slot drafts (one token: what follows them) and it is accepted.
    "drafting": lambda slot: dict(temperature=0.0, logit_bias=((_repeated(slot), 100.0),)),
    # Greedy, the first slot's output held to a regex (issue 40): the grammar's kernels and the mask's bytes with one
    # constrained row resident.
    "constrained": lambda slot: dict(temperature=0.0, **(dict(grammar_kind=int(GrammarKind.REGEX),
                                                              grammar=CONSTRAINT) if slot == 0 else {})),
}
WARM_STEPS = 50  # a constrained record waits for its grammar's table (lowered on the gate's threads, a second)
CONSTRAINT = "[a-z ]+"  # a small automaton (a bounded repetition's grows with its bound); checked still walking
# `drafting`'s speculation: vLLM's n-gram method, as its docs show it.
DRAFTING = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _repeated(slot: int) -> int:
    return 10 + slot % 50


def prompt_for(requests: str, slot: int) -> list[int]:
    if requests == "drafting":
        return [_repeated(slot)] * 4
    return [1 + slot % 50, 2, 3]


def bucket_for(requests: str, slots: int, bucket: int) -> int:
    """The token bucket counted: a drafting step's holds every slot's run of 1 + K tokens."""
    return max(bucket, slots * (1 + DRAFTING["num_speculative_tokens"])) if requests == "drafting" else bucket


def count_step(model_dir: Path, slots: int, context: int, bucket: int, kernels: str = "triton",
               requests: str = "greedy") -> dict[str, object]:
    """One steady decode step of the device step (every slot resident, decoding): the kernels of its phases
    (`layer`: the stand-in's one layer; `forward`: the rest of the forward, the embedding and the last residual
    add; `logits`: the final norm and the output projection; `bookkeeping`: everything else, the sampler and the
    exchange with the table included), and the ops and bytes outside the model's forward and logits."""
    import torch

    from blink.bench.engine import kernel_count as kc
    from blink.bench.lib.machine import environment
    from blink.engine.core.sampler import TORCH_SAMPLER, Sampler
    from blink.engine.drive import device_step
    from blink.engine.drive.device_step import DeviceStep
    from blink.engine.engine import Engine, EngineConfig
    from blink.engine.kernels import sampler as sampler_kernels
    from blink.engine.model import model as model_module
    from blink.shared.slot_table import Request, SlotTable

    drafting = requests == "drafting"
    with environment(BLINK_KERNELS=kernels):
        engine = Engine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=slots,
                                     max_num_batched_tokens=max(bucket, slots), max_model_len=context, swap_space=0,
                                     speculative_config=DRAFTING if drafting else None))
    counted_sampler = engine.step.sampler
    if kernels == "triton":  # interpreted, wide blocks run faster; the passes and launches counted do not depend on it
        wide = dict(block=4096, chunk=32768)
        counted_sampler = Sampler(partial(sampler_kernels.fused_sample, **wide),
                                  partial(sampler_kernels.token_logprobs, **wide),
                                  replace(counted_sampler.step, **wide))
    engine.step.sampler = TORCH_SAMPLER  # the warm-up's tokens need not be the kernels' (interpreted, they are slow)
    table = SlotTable.create(f"bench-step-{uuid.uuid4().hex[:10]}", engine.geometry(window=1 << 16))
    model = engine.model
    try:
        device = DeviceStep(engine, table)
        for slot in range(slots):
            table.publish(slot, Request(prompt_for(requests, slot), max_tokens=context - 8,
                                        **REQUESTS[requests](slot)))
        # The clock stands still: the step-cost fit learns nothing from interpreted steps (seconds, not a GPU's
        # milliseconds), and its zero fit lets drafts pay, as a GPU's fixed cost of a step does.
        device.clock[0] = time.monotonic()
        with torch.inference_mode(), _as_on_a_gpu():
            for i in range(WARM_STEPS):  # admission and prefill, then decodes: three steps once every slot produced
                if device.grammars.poll():  # a grammar's table to the arena, as the modes' gate thread does
                    time.sleep(0.1)  # still lowering: the steps wait for it, not run out
                device.run(device.buckets[-1])
                if i >= 2 and all(int(table.slots["produced"][s]) > 0 for s in range(slots)):
                    break
                if i == WARM_STEPS - 1:
                    raise TimeoutError(f"not every request was admitted and decoding after {WARM_STEPS} steps")
            engine.step.sampler = counted_sampler
            if counted_sampler.step is not None:  # what a GPU's first run of the bucket allocates, before capture
                counted_sampler.step.reserve(torch.device("cpu"))
            drafts_before = int(engine.state.spec_counts[0])  # read before the count: a host read is counted
            counter = kc.KernelCounter()
            with counter, kc.triton_launches(counter), \
                    kc.as_one_kernel(counter, model_module, "linear", "cublas.linear"), \
                    kc.phase(counter, model, "forward", "forward", count_bytes=False), \
                    kc.phase(counter, model, "layer", "layer", count_bytes=False), \
                    kc.phase(counter, model, "logits", "logits", count_bytes=False), \
                    kc.bytes_paused(counter, device_step, ("take_requests", "emit", "report_demand")), \
                    _kernel_passes(counter, sampler_kernels):
                started = time.perf_counter()
                device.run(bucket)
                seconds = time.perf_counter() - started
            drafted = int(engine.state.spec_counts[0]) - drafts_before  # slots that drafted in the step counted
            first_ended = int(table.slots["finish_reason"][0]) != 0
        device.close()
    finally:
        table.unlink()
    top = dict(sorted(counter.by_op.items(), key=lambda kv: -kv[1][1]))
    summary = counter.summary()
    if summary["kernels"].get("layer", 0) and len(model.layers) != 1:
        raise AssertionError("the stand-in must have one layer: its layer's kernels are counted per layer")
    if requests == "constrained" and first_ended:
        raise AssertionError("the constrained request ended before the step counted: it counts no constrained row")
    if drafting and drafted < slots:
        raise AssertionError(f"only {drafted} of {slots} slots drafted in the step counted: it counts no drafting step")
    return {"ops": counter.ops, "bytes": counter.bytes, "seconds": seconds, "top": top, "slots_drafting": drafted,
            **summary}


def kernel_figures(counted: dict, layers: int) -> dict[str, int]:
    """A step's kernels for a model of `layers` layers, from a one-layer stand-in's count."""
    phases = counted["kernels"]
    per_layer, rest, logits = phases.get("layer", 0), phases.get("forward", 0), phases.get("logits", 0)
    bookkeeping = phases.get("bookkeeping", 0)
    return {"kernels_per_step": per_layer * layers + rest + logits + bookkeeping,
            "kernels_forward_per_layer": per_layer, "kernels_forward_rest": rest, "kernels_logits": logits,
            "kernels_bookkeeping": bookkeeping}


H100_SMS = 132


@contextmanager
def _as_on_a_gpu():
    """The step's choices as an H100 makes them, so it launches what it launches there: the attention's key splits
    (`key_splits` reads the SM count on CUDA; on the CPU it chooses none), and no part skipped for having nothing to
    do (`state.none_set` looks only on the CPU, eager; every module that took it by name gets the GPU's answer)."""
    import sys

    import triton

    from blink.engine.core import state
    from blink.engine.kernels import attention

    looks = state.none_set
    takers = [m for name, m in list(sys.modules.items())
              if name.startswith("blink.") and getattr(m, "none_set", None) is looks]
    for module in takers:
        module.none_set = lambda *masks: False
    chosen = attention.key_splits

    def on_an_h100(q, kv_heads):
        return min(attention.MAX_SPLITS, triton.next_power_of_2(-(-2 * H100_SMS // kv_heads)))

    attention.key_splits = on_an_h100
    try:
        yield
    finally:
        attention.key_splits = chosen
        for module in takers:
            module.none_set = looks


@contextmanager
def _kernel_passes(counter, kernels):
    """The fused sampler's kernels' bytes, by their own count of passes: each pass reads its row of logits
    (interpreted, a launch copies its arguments, which a GPU does not). Their kernels count as any others."""
    from blink.engine.kernels import step_sampler as step_kernels

    draw, logprobs, step_run = kernels._draw, kernels.logprobs, step_kernels._run

    def read(name: str, passes, logits) -> None:
        counter.in_launch = True  # the sum below is the benchmark's, not the step's
        try:
            counter.add(name, 1, int(passes.sum()) * logits.shape[1] * logits.element_size())
        finally:
            counter.in_launch = False

    def counted_draw(logits, rows, block, chunk):
        outer, counter.bytes_paused = counter.bytes_paused, True
        try:
            tokens, passes = draw(logits, rows, block, chunk)
        finally:
            counter.bytes_paused = outer
        read("triton.sample", passes, logits)
        return tokens, passes

    def counted_logprobs(logits, asked, tokens, block, *chunk):
        outer, counter.bytes_paused = counter.bytes_paused, True
        try:
            out = logprobs(logits, asked, tokens, block, *chunk)
        finally:
            counter.bytes_paused = outer
        read("triton.logprobs", out[3], logits)
        return out

    def counted_step(logits, passes, launch):
        outer, counter.bytes_paused = counter.bytes_paused, True
        try:
            step_run(logits, passes, launch)
        finally:
            counter.bytes_paused = outer
        read("triton.step_sample", passes, logits)

    kernels._draw, kernels.logprobs, step_kernels._run = counted_draw, counted_logprobs, counted_step
    try:
        yield
    finally:
        kernels._draw, kernels.logprobs, step_kernels._run = draw, logprobs, step_run


@contextmanager
def _stand_in(vocab: int, context: int):
    """A one-layer bfloat16 Llama with the real vocabulary and context, random weights, and the tiny model's
    tokenizer and end-of-sequence id (the step never detokenizes; a grammar's table is made over the tokenizer, which
    must hold the id that ends it)."""
    import shutil

    from safetensors.torch import save_file

    from blink.engine.model.tiny_model import ensure_tiny_model, random_weights

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_act="silu",
                  hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=context, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
    with tempfile.TemporaryDirectory(prefix="blink-bench-step-") as tmp:
        target = Path(tmp)
        tiny = json.loads((ensure_tiny_model() / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(config | {"eos_token_id": tiny["eos_token_id"]}))
        shutil.copy(ensure_tiny_model() / "tokenizer.json", target / "tokenizer.json")
        save_file(random_weights(config), str(target / "model.safetensors"), metadata={"format": "pt"})
        yield target
