"""Structured outputs in the graph and persistent drive modes on a GPU: the grammar kernels captured in the step's
graphs, the gate's own thread readying constrained records while the driver runs, and a regex, a choice and a JSON
schema followed beside an unconstrained row whose greedy tokens are those it has alone. Skipped without CUDA (the CPU
runs the same device step eagerly: tests/engine/test_grammar_device_step.py)."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
import torch

from blink.engine.drive.device_step import DeviceStep
from blink.engine.engine import Engine, EngineConfig
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.grammar import GrammarKind, GrammarSpec
from blink.shared.slot_table import Finish, Geometry, Request, SlotTable
from tests.support.grammar_requests import CHOICES, PLAIN, REGEX, constrained, serve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the device drive modes need a CUDA GPU")

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 20}},
          "required": ["kind", "age"]}
def _driver(mode: str, table: SlotTable):
    engine = Engine(EngineConfig(model=str(ensure_tiny_model()), max_num_seqs=4, max_num_batched_tokens=32,
                                 num_pages=64, page_size=8, max_model_len=96, enable_prefix_caching=False))
    step = DeviceStep(engine, table)
    if mode == "graph":
        from blink.engine.drive.graph import GraphDriver

        return GraphDriver(step, table)
    from blink.engine.drive.persistent import PersistentDriver, PersistentUnavailable

    try:
        return PersistentDriver(step, table)
    except PersistentUnavailable as e:
        step.close()
        pytest.skip(f"the persistent mode is unavailable here: {e}")


def _serve(table: SlotTable, requests: dict[int, Request], seconds: float = 60.0) -> dict:
    """Serves `requests` while the driver runs (its own threads step the device and poll the gate)."""
    return serve(table, requests, lambda: time.sleep(1e-3), seconds)


@pytest.mark.parametrize("mode", ["graph", "persistent"])
def test_the_device_modes_walk_grammars(mode):
    table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(4, 64, 3, page_size=8, max_grammar_bytes=1024))
    driver = _driver(mode, table)
    try:
        driver.start()
        alone = _serve(table, {1: PLAIN})[1]
        for round_ in range(2):  # the second round reuses the slots, and the arena the first freed
            got = _serve(table, {
                0: constrained(GrammarSpec(GrammarKind.REGEX, REGEX), temperature=1.0, seed=3 + round_),
                1: PLAIN,
                2: constrained(GrammarSpec.choice(CHOICES), temperature=1.0, seed=round_),
                3: constrained(GrammarSpec.json_schema(SCHEMA), temperature=1.0, seed=11 + round_),
            })
            decode = driver.step.engine.tokenizer.decode
            assert got[1] == alone, round_
            assert all(got[s][1] == Finish.STOP for s in (0, 2, 3)), got
            assert re.fullmatch(REGEX, decode(got[0][0])), decode(got[0][0])
            assert decode(got[2][0]) in CHOICES
            answer = json.loads(decode(got[3][0]))
            assert answer["kind"] in ("cat", "dog") and 0 <= answer["age"] <= 20 and set(answer) == {"kind", "age"}
        time.sleep(0.05)  # the gate's poll frees the last blocks
        grammars = driver.step.grammars
        assert grammars.blocks == {} and grammars.space.free_words == grammars.space.words
        assert (grammars.state == -1).all()
    finally:
        driver.close()
        table.unlink()
