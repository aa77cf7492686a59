"""Constrained requests in `blink bench serve` (vLLM's benchmark_serving_structured_output.py's
`--structured-output-ratio`): a seeded share of the requests asks for a structured output through vLLM's
`structured_outputs` field, and the constrained and unconstrained requests get figures of their own, so a run
shows what a grammar costs a request beside the plain ones it shares the batch with (issue 40: on a GPU, P99 TPOT
of constrained requests under CPU interference, persistent against host).

The JSON schema and the regex run long (nothing closes them soon), so a constrained request decodes about as many
tokens as a plain one and their TPOTs compare; a choice ends in a few tokens.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

from blink.bench.lib.backends import RequestRecord
from blink.bench.lib.dataset import SampleRequest
from blink.bench.serving.classes import one_class

# kind -> vLLM's structured_outputs (StructuredOutputsParams): one of a JSON schema, a regex, a choice
KINDS = {
    "json": {"json": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "count": {"type": "integer", "minimum": 0}}, "required": ["name", "count"]}}},
        "required": ["items"]}},
    "regex": {"regex": "([a-z]+ ){1,512}[a-z]+\\."},
    "choice": {"choice": ["yes", "no", "it depends on the context given"]},
}
GROUPS = ("constrained", "unconstrained")


def ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a share from 0 to 1")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--structured-output-ratio", type=ratio, default=0.0, metavar="SHARE",
                   help="the share of requests that ask for a structured output (vLLM's structured_outputs), with "
                   "figures of their own beside the unconstrained ones'")
    p.add_argument("--structured-output", choices=sorted(KINDS), default="json",
                   help="what the constrained requests ask for: a JSON schema, a regex or a choice")


def assign(samples: list[SampleRequest], share: float, kind: str, seed: int) -> list[SampleRequest]:
    """A seeded `share` of the samples constrained to `kind`; a generator of its own (as classes.assign), so the
    prompts and a class mix stay as they were."""
    rng = random.Random(f"blink-bench-structured:{seed}")
    return [replace(s, structured=KINDS[kind]) if rng.random() < share else s for s in samples]


def figures(records: list[RequestRecord], duration_s: float) -> dict[str, dict[str, object]]:
    """Figures per group present (classes.one_class's, without SLOs); throughput is over the whole run."""
    groups = {"constrained": [r for r in records if r.constrained],
              "unconstrained": [r for r in records if not r.constrained]}
    return {name: one_class(subset, duration_s, {}) for name, subset in groups.items() if subset}
