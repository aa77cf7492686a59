"""`blink bench projections`: every projection of a model's step on the CPU, in each weight form this machine runs
(engine/model/linear.py), for decode and prefill row counts, the forms alternated round after round in one process.

The forms: `plain` (F.linear on the weight as checkpoints hold it), `onednn` (oneDNN's packed layout), `blocked`
(Blink's AVX-512 kernel) and `amx` (Blink's AMX kernel), each where this CPU and torch have it; `prepare` says which
one the engine picks. Blink's two are in huge pages, as the engine holds them (blink.engine.model.huge_pages), and
again in torch's 4 KiB pages (`blocked-4k`, `amx-4k`). The weights are random, of the shapes of `blink bench
offline`'s 125M Llama unless --layers/--vocab say otherwise; a step's projections are the fused qkv, o, gate-up and
down of every layer, then the output embedding. Prints medians with their range and the bandwidth they read the
weights at, and each form's time against oneDNN's (and a 4 KiB form's against its huge pages); saves JSON under
--result-dir; asserts nothing.

    blink bench projections                    # float32 and bfloat16, 1 to 512 rows, about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from blink.bench.engine.offline import MODEL_SHAPE
from blink.bench.lib.machine import blink_source, machine, save
from blink.engine.model import huge_pages
from blink.engine.model import linear as projections

Weight = torch.Tensor
FORMS: dict[str, tuple[Callable[[Weight], bool], Callable[[Weight], Weight], Callable[..., torch.Tensor]]] = {
    # name: (whether this machine has it for the weight, the weight in that form, the product)
    "plain": (lambda w: True, lambda w: w, F.linear),
    "onednn": (projections.can_pack, projections.pack, projections.linear),
    "blocked": (projections.blocked_takes, projections.block, projections.linear),
    "amx": (projections.amx_takes, huge_pages.moved, projections.linear),
    # the engine's forms again in torch's 4 KiB pages (a clone is torch's memory), against their huge pages
    "blocked-4k": (projections.blocked_takes, lambda w: projections.block(w).clone(), projections.linear),
    "amx-4k": (projections.amx_takes, lambda w: w, projections.linear),
}
SMALL_PAGES = "-4k"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtypes", default="float32,bfloat16", help="float32, bfloat16 or both")
    p.add_argument("--rows", default="1,4,16,64,512", help="rows of x (a decode step's sequences, a prefill chunk)")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds; figures are their medians")
    p.add_argument("--layers", type=int, default=MODEL_SHAPE["num_hidden_layers"])
    p.add_argument("--vocab", type=int, default=MODEL_SHAPE["vocab_size"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", type=Path, default=Path("."))


def weight_shapes(layers: int, vocab: int) -> list[tuple[int, int]]:
    """[N, K] of each projection of a step, in the order the forward runs them."""
    hidden, inter = MODEL_SHAPE["hidden_size"], MODEL_SHAPE["intermediate_size"]
    kv = hidden // MODEL_SHAPE["num_attention_heads"] * MODEL_SHAPE["num_key_value_heads"]
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers + [
        (vocab, hidden)]


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    shapes = weight_shapes(args.layers, args.vocab)
    rows = [int(r) for r in args.rows.split(",")]
    results = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        weights = [torch.randn(n, k, dtype=dtype) * 0.02 for n, k in shapes]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        forms = {name: [make(w) for w in weights] for name, (has, make, _) in FORMS.items()
                 if all(has(w) for w in weights)}
        chosen = _form_of(projections.prepare(weights[0]))
        print(f"\n{dtype_name}: {nbytes / 1e6:.0f} MB of weights; forms here: {', '.join(forms)}; the engine's: "
              f"{chosen}")
        results[dtype_name] = {"weight_bytes": nbytes, "forms": list(forms), "engine_form": chosen, "rows": {}}
        for m in rows:
            xs = {k: torch.randn(m, k, dtype=dtype) for k in {k for _, k in shapes}}
            samples = {name: [] for name in forms}
            for _ in range(args.rounds):
                for name, ws in forms.items():
                    product = FORMS[name][2]
                    start = time.perf_counter()
                    for w, (_, k) in zip(ws, shapes, strict=True):
                        product(xs[k], w)
                    samples[name].append(time.perf_counter() - start)
            results[dtype_name]["rows"][m] = {name: [s * 1e3 for s in v] for name, v in samples.items()}
            _report(m, samples, nbytes)
    result = {"benchmark": "projections", "machine": machine(), "blink": blink_source(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "shapes": shapes, "rounds": args.rounds, "seed": args.seed,
              "ms_per_step": results}
    print(f"\nsaved {save('projections', result, args.result_dir)}")


def _form_of(weight: torch.Tensor) -> str:
    if weight.dim() == 4:
        return "blocked"
    if weight.is_mkldnn:
        return "onednn"
    return "amx" if projections.amx_takes(weight) else "plain"


def _report(m: int, samples: dict[str, list[float]], nbytes: int) -> None:
    medians = {name: statistics.median(v) for name, v in samples.items()}
    base = medians.get("onednn")
    for name, med in medians.items():
        spread = f"[{min(samples[name]) * 1e3:.2f}, {max(samples[name]) * 1e3:.2f}]"
        against = f"  {base / med:.2f}x oneDNN's speed" if base and name != "onednn" else ""
        if name.endswith(SMALL_PAGES):
            against += f", its huge pages {med / medians[name.removesuffix(SMALL_PAGES)]:.2f}x as fast"
        print(f"  {m:4d} rows  {name:8s} {med * 1e3:8.2f} ms {spread:>18}  {nbytes / med / 1e9:5.1f} GB/s{against}")
