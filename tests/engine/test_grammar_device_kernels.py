"""The device modes' grammar walk kernels (blink.engine.kernels.grammar, in Triton's interpreter) against their torch
references (blink.engine.core.grammar_table): the mask of rows in every state of two grammars beside unconstrained
rows and rows whose grammar waits for a token (the end of a thinking model's reasoning), the advance by allowed,
refused, awaited and no tokens, and at a finish, and the landing of admitted slots."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernels

import random

import numpy as np
import pytest
import torch

from blink.engine.core.grammar_table import GrammarTable, Lowering, advance_reference, allowed, mask_reference
from blink.engine.kernels import grammar as kernels
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.grammar import GrammarKind, GrammarSpec
from blink.shared.tokenizer import Tokenizer

VOCAB = 1174  # the tiny model's: 37 words a mask, the last one partial


@pytest.fixture(scope="module")
def tables() -> list[GrammarTable]:
    lowering = Lowering(Tokenizer(ensure_tiny_model()).raw, VOCAB, [1])
    return [lowering.lower(GrammarSpec(GrammarKind.REGEX, r"[a-c]{2,5}(x|yz)")),
            lowering.lower(GrammarSpec.json_schema({"type": "object", "properties": {
                "kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 20}},
                "required": ["kind", "age"]}))]


def _arena(tables: list[GrammarTable]) -> tuple[torch.Tensor, list[int]]:
    """The blocks one after another, behind 5 words of nothing (a block lands anywhere)."""
    bases, words = [], [np.full(5, -7, dtype=np.int32)]
    at = 5
    for table in tables:
        bases.append(at)
        words.append(table.words)
        at += table.words.size
    return torch.from_numpy(np.concatenate(words)), bases


def test_the_mask_kernel_masks_as_the_reference_does(tables):
    arena, bases = _arena(tables)
    rng = random.Random(0)
    S = 6
    state = torch.full((S,), -1, dtype=torch.int32)
    wait = torch.full((S,), -1, dtype=torch.int32)
    base = torch.zeros(S, dtype=torch.int64)
    for trial in range(6):
        for s in range(4):  # slots 4 and 5 stay unconstrained
            g = rng.randrange(2)
            state[s], base[s] = rng.randrange(tables[g].states), bases[g]
            wait[s] = rng.choice([-1, -1, 7])  # some still reason: left alone
        row_slot = torch.tensor([rng.randrange(S) for _ in range(7)], dtype=torch.int64)
        logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(trial))
        expected = logits.clone()
        mask_reference(expected, row_slot, state, wait, base, arena)
        kernels.mask(logits, row_slot, state, wait, base, arena)
        assert torch.equal(logits, expected), trial
        for r, s in enumerate(row_slot.tolist()):  # what the reference masks is what the state allows
            kept = torch.isfinite(expected[r]).nonzero().flatten().tolist()
            if state[s] < 0 or wait[s] >= 0:
                assert len(kept) == VOCAB
            else:
                assert kept == allowed(tables[bases.index(int(base[s]))], int(state[s])).tolist()


def test_the_advance_kernel_walks_as_the_reference_does(tables):
    arena, bases = _arena(tables)
    rng = random.Random(1)
    S = 8
    for trial in range(10):
        state = torch.full((S,), -1, dtype=torch.int32)
        wait = torch.full((S,), -1, dtype=torch.int32)
        base = torch.zeros(S, dtype=torch.int64)
        token = torch.full((S,), -1, dtype=torch.int64)
        finish = torch.zeros(S, dtype=torch.int64)
        for s in range(6):
            g = rng.randrange(2)
            state[s], base[s] = rng.randrange(tables[g].states), bases[g]
            choices = allowed(tables[g], int(state[s])).tolist()
            token[s] = rng.choice([rng.choice(choices), rng.choice(choices), rng.randrange(VOCAB), -1])
            finish[s] = int(rng.random() < 0.15)
            if rng.random() < 0.4:  # still reasoning: the token drawn ends it, or not
                wait[s] = token[s] if rng.random() < 0.5 and token[s] >= 0 else 1173
        token[7] = 5  # unconstrained: stays so
        expected, expected_wait = state.clone(), wait.clone()
        advance_reference(token, finish, expected, expected_wait, base, arena)
        before, waited = state.clone(), wait.clone()
        kernels.advance(token, finish, state, wait, base, arena)
        assert torch.equal(state, expected) and torch.equal(wait, expected_wait), trial
        assert state[7] == -1
        for s in range(6):  # a waiting slot stays where it was; the awaited token ends its wait
            if waited[s] >= 0 and not finish[s]:
                assert state[s] == before[s]
                assert wait[s] == (-1 if token[s] == waited[s] else waited[s])


def test_admitted_slots_land_at_their_grammars_first_state_and_wait():
    S = 5
    admit = torch.tensor([1, 1, 1, 0, 1], dtype=torch.int64)
    ready = torch.tensor([1, 1, 0, 1, 2], dtype=torch.int32)  # READY, READY, none, READY (not admitted), TAKEN
    ready_base = torch.tensor([10, 20, 30, 40, 50], dtype=torch.int64)
    ready_start = torch.tensor([3, 4, 5, 6, 7], dtype=torch.int32)
    ready_wait = torch.tensor([-1, 9, 9, 9, 9], dtype=torch.int32)
    base = torch.zeros(S, dtype=torch.int64)
    state = torch.full((S,), 8, dtype=torch.int32)  # what earlier requests left
    wait = torch.full((S,), 8, dtype=torch.int32)
    kernels.land(admit, ready, ready_base, ready_start, ready_wait, base, state, wait)
    assert state.tolist() == [3, 4, -1, 8, -1]
    assert wait.tolist() == [-1, 9, -1, 8, -1]
    assert base.tolist()[:2] == [10, 20]
    assert ready.tolist() == [2, 2, 0, 1, 2]
