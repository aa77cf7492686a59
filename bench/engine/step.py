"""`blink bench step`: what one captured step costs outside the model, counted rather than timed.

The device modes replay the same step whatever the batch, so its bookkeeping (admission, planning, sampling, the
commit, the exchange with the slot table) is paid every step. This runs that step (`DeviceStep.run`, on the CPU
with the exchange kernels in Triton's interpreter) under a torch dispatch mode that counts every tensor op outside
the model's forward and logits, and the bytes each one reads and writes: its tensors' sizes, except that a view
moves nothing and an indexed read or write (index, index_put_, scatter_...) touches the rows it names, not the
whole tensor it indexes. The exchange kernels (admission from the table,
emission into it, the demand) are not counted: interpreted, they copy every argument, which a GPU does not; on
the device they read each slot's control words, and a prompt once, when it is admitted. The shapes that matter
are the vocabulary, the context, the slots and the token bucket; the model itself is a one-layer stand-in with
the real vocabulary, so the counts hold for the 1B and 8B Llama 3 shapes alike, and are compared with their
weight bytes.

The step is counted as a GPU runs it (`--kernels triton`: the model's Triton kernels, interpreted here and
uncounted like the rest of the forward, so the step builds only their row lists; the fused sampler, whose kernels
count their own passes over the logits, each pass counted as reading a row of logits). `--kernels torch` counts
the step as the CPU runs it: the torch attention's gathers and the torch sampler. `--requests` picks what the resident
requests ask for: `greedy`, or `mixed` (half greedy, half sampling with temperature, top-k, top-p, min-p,
penalties, a logit bias and logprobs): the captured step is the same code for both; what it costs is not.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from contextlib import contextmanager
from functools import partial
from pathlib import Path

SHAPES = {  # Llama 3's vocabulary; the weight bytes one decode step reads in bf16
    "llama3-1b": {"vocab": 128256, "weight_bytes": 2.47e9},
    "llama3-8b": {"vocab": 128256, "weight_bytes": 16.06e9},
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
                counted = count_step(model_dir, slots, args.context, args.bucket, args.kernels, requests)
                for shape in args.shape:
                    if (args.vocab or SHAPES[shape]["vocab"]) != vocab:
                        continue
                    share = counted["bytes"] / SHAPES[shape]["weight_bytes"]
                    rows.append({"shape": shape, "vocab": vocab, "slots": slots, "context": args.context,
                                 "bucket": args.bucket, "kernels": args.kernels, "requests": requests, **counted,
                                 "weight_bytes": SHAPES[shape]["weight_bytes"], "bytes_over_weights": share})
                    print(f"{shape:10s} vocab {vocab:6d} slots {slots:4d} context {args.context:6d} bucket "
                          f"{args.bucket:3d} {requests:6s} ({args.kernels}): {counted['ops']:4d} ops, "
                          f"{counted['bytes'] / 1e9:7.3f} GB outside the forward = {share:6.1%} of the weights "
                          f"({counted['seconds']:.2f} s on this CPU)")
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
}


def count_step(model_dir: Path, slots: int, context: int, bucket: int, kernels: str = "triton",
               requests: str = "greedy") -> dict[str, object]:
    """Ops and bytes of one steady decode step of the device step (every slot resident, decoding), outside the
    model's forward and logits."""
    import torch

    from blink.bench.lib.machine import environment
    from blink.engine.core.sampler import TORCH_SAMPLER, Sampler
    from blink.engine.drive import device_step
    from blink.engine.drive.device_step import DeviceStep
    from blink.engine.engine import Engine, EngineConfig
    from blink.engine.kernels import sampler as sampler_kernels
    from blink.shared.slot_table import Request, SlotTable

    with environment(BLINK_KERNELS=kernels):
        engine = Engine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=slots,
                                     max_num_batched_tokens=max(bucket, slots), max_model_len=context, swap_space=0))
    counted_sampler = engine.step.sampler
    if kernels == "triton":  # interpreted, a wide block runs faster; the passes counted do not depend on it
        wide = dict(block=4096)
        counted_sampler = Sampler(partial(sampler_kernels.fused_sample, **wide),
                                  partial(sampler_kernels.token_logprobs, **wide))
    engine.step.sampler = TORCH_SAMPLER  # the warm-up's tokens need not be the kernels' (interpreted, they are slow)
    table = SlotTable.create(f"bench-step-{uuid.uuid4().hex[:10]}", engine.geometry(window=1 << 16))
    try:
        device = DeviceStep(engine, table)
        for slot in range(slots):
            table.publish(slot, Request([1 + slot % 50, 2, 3], max_tokens=context - 8, **REQUESTS[requests](slot)))
        with torch.inference_mode():
            for _ in range(3):  # admission and prefill, then decodes
                device.clock[0] = time.monotonic()
                device.run(device.buckets[-1])
            engine.step.sampler = counted_sampler
            counter = _OpCounter()
            with counter, _uncounted(counter, engine.model, ("forward", "logits")), \
                    _uncounted(counter, device_step, ("take_requests", "emit", "report_demand")), \
                    _kernel_passes(counter, sampler_kernels):
                started = time.perf_counter()
                device.clock[0] = time.monotonic()
                device.run(bucket)
                seconds = time.perf_counter() - started
        device.close()
    finally:
        table.unlink()
    top = dict(sorted(counter.by_op.items(), key=lambda kv: -kv[1][1]))
    return {"ops": counter.ops, "bytes": counter.bytes, "seconds": seconds, "top": top}


_INDEXED_READS = {"aten.index", "aten.gather", "aten.index_select"}
_INDEXED_WRITES = {"aten.index_put_", "aten._index_put_impl_", "aten.scatter_", "aten.scatter_add_",
                   "aten.index_copy_", "aten.index_fill_"}


class _OpCounter:
    """Counts the aten ops dispatched while it is active (and not paused), and their tensors' bytes."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not counter.paused:
                    counter.record(func, args, kwargs or {}, out)
                return out

        self.mode = Mode()
        self.paused = False
        self.ops = 0
        self.bytes = 0
        self.by_op: dict[str, list[int]] = {}

    def add(self, name: str, ops: int, nbytes: int) -> None:
        self.ops += ops
        self.bytes += nbytes
        entry = self.by_op.setdefault(name, [0, 0])
        entry[0] += ops
        entry[1] += nbytes

    def record(self, func, args: tuple, kwargs: dict, out) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        def size(*values) -> int:
            return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))

        name = str(func.overloadpacket)
        if func.is_view:
            nbytes = 0  # a new shape over the same memory
        elif name in _INDEXED_READS:
            nbytes = size(args[1:], kwargs) + 2 * size(out)  # the rows read, the indices, the rows written
        elif name in _INDEXED_WRITES:
            nbytes = 2 * size(args[1:], kwargs)  # the indices and values, read; as many elements updated
        else:
            nbytes = size(args, kwargs, out)
        self.add(name, 1, nbytes)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@contextmanager
def _uncounted(counter: _OpCounter, owner, names: tuple[str, ...]):
    """These attributes of `owner` run uncounted: the model's forward and logits (this benchmark is about
    everything else), the exchange kernels (see the module's docstring)."""
    originals = {name: getattr(owner, name) for name in names}

    def paused(fn):
        def call(*args, **kwargs):
            counter.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                counter.paused = False
        return call

    for name, fn in originals.items():
        setattr(owner, name, paused(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(owner, name, fn)



@contextmanager
def _kernel_passes(counter: _OpCounter, kernels):
    """The fused sampler's kernels, counted by their own count of passes: each pass reads its row of logits
    (interpreted, a launch copies its arguments, which a GPU does not)."""
    draw, logprobs = kernels._draw, kernels._logprobs

    def counted_draw(logits, rows, block):
        counter.paused = True
        try:
            tokens, passes = draw(logits, rows, block)
            counter.add("triton.sample", 1, int(passes.sum()) * logits.shape[1] * logits.element_size())
        finally:
            counter.paused = False
        return tokens, passes

    def counted_logprobs(logits, asked, tokens, block):
        counter.paused = True
        try:
            out = logprobs(logits, asked, tokens, block)
            counter.add("triton.logprobs", 1, int(out[3].sum()) * logits.shape[1] * logits.element_size())
        finally:
            counter.paused = False
        return out

    kernels._draw, kernels._logprobs = counted_draw, counted_logprobs
    try:
        yield
    finally:
        kernels._draw, kernels._logprobs = draw, logprobs


@contextmanager
def _stand_in(vocab: int, context: int):
    """A one-layer Llama with the real vocabulary and context, random weights, and the tiny model's tokenizer
    (the step never detokenizes)."""
    import shutil

    from safetensors.torch import save_file

    from blink.engine.model.tiny_model import ensure_tiny_model, random_weights

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_act="silu",
                  hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=context, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="float32", eos_token_id=vocab - 1)
    with tempfile.TemporaryDirectory(prefix="blink-bench-step-") as tmp:
        target = Path(tmp)
        (target / "config.json").write_text(json.dumps(config))
        shutil.copy(ensure_tiny_model() / "tokenizer.json", target / "tokenizer.json")
        save_file(random_weights(config), str(target / "model.safetensors"), metadata={"format": "pt"})
        yield target
