"""Structured outputs in the device step: each constrained row's logits masked by its grammar's state, and each
constrained slot's state advanced by the token it committed, as Triton kernels over the grammar arena
(blink.engine.drive.device_grammars; a block's layout: blink.engine.core.grammar_table). A slot's state is -1 while
it has no grammar: its rows are left as they are. A slot's `wait` is the token its grammar waits for (a thinking
model's end of reasoning, the record's reasoning_end_id), -1 once it came or where there is none: until then its rows
are left alone and its state stays where it starts. Torch references: blink.engine.core.grammar_table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.engine.core.grammar_table import HEADER_WORDS, STATE_WORDS

READY = tl.constexpr(1)  # device_grammars.READY: the slot's block is in the arena, its request may be admitted
TAKEN = tl.constexpr(2)  # device_grammars.TAKEN: admitted with it (so a request after it waits for its own)


@triton.jit
def _mask(logits, stride, row_slot, state, wait, base, arena, vocab, STATE_WORDS: tl.constexpr,
          HEADER_WORDS: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per row: -inf where the row's slot's state allows no token."""
    r = tl.program_id(0)
    s = tl.load(row_slot + r)
    at = tl.load(state + s)
    if at < 0:
        return
    if tl.load(wait + s) >= 0:
        return
    block = tl.load(base + s)
    mask = block + tl.load(arena + block + HEADER_WORDS + at * STATE_WORDS).to(tl.int64)
    row = logits + r.to(tl.int64) * stride
    start = 0
    while start < vocab:
        v = start + tl.arange(0, BLOCK_V)
        inside = v < vocab
        words = tl.load(arena + mask + v // 32, mask=inside, other=0)
        refused = ((words >> (v % 32)) & 1) == 0
        tl.store(row + v, tl.full((BLOCK_V,), float("-inf"), row.dtype.element_ty), mask=inside & refused)
        start += BLOCK_V


@triton.jit
def _advance(token, finish, state, wait, base, arena, STATE_WORDS: tl.constexpr, HEADER_WORDS: tl.constexpr):
    """One program per slot: its state moves by the token it committed (a binary search of the state's sorted
    tokens); -1 once it finished, or where its state does not allow the token (its rest goes unconstrained). A slot
    that waits stays where it is; the token it waits for ends the wait (and is not the grammar's)."""
    s = tl.program_id(0)
    at = tl.load(state + s)
    if at < 0:
        return
    if tl.load(finish + s) != 0:
        tl.store(state + s, -1)
        return
    t = tl.load(token + s).to(tl.int32)
    if t < 0:
        return
    awaited = tl.load(wait + s)
    if awaited >= 0:
        if t == awaited:
            tl.store(wait + s, -1)
        return
    block = tl.load(base + s)
    words = arena + block
    entry = words + HEADER_WORDS + at * STATE_WORDS
    low = tl.load(entry + 1)
    end = tl.load(entry + 2)
    high = end
    while low < high:
        middle = (low + high) // 2
        if tl.load(words + middle) < t:
            low = middle + 1
        else:
            high = middle
    found = low < end
    if found:
        found = tl.load(words + low) == t
    if found:
        tl.store(state + s, tl.load(words + low + tl.load(words)))
    else:
        tl.store(state + s, -1)


@triton.jit
def _land(admit, ready, ready_base, ready_start, ready_wait, base, state, wait, S, BLOCK_S: tl.constexpr):
    """One program: each slot admitted this step starts at its grammar's first state (-1 without one), waiting for
    the token the gate wrote (-1: none), and its ready word says its block was taken."""
    s = tl.arange(0, BLOCK_S)
    admitted = (s < S) & (tl.load(admit + s, mask=s < S, other=0) != 0)
    with_grammar = admitted & (tl.load(ready + s, mask=admitted, other=0, volatile=True) == READY)
    tl.store(base + s, tl.load(ready_base + s, mask=with_grammar, other=0), mask=with_grammar)
    tl.store(state + s, tl.where(with_grammar, tl.load(ready_start + s, mask=with_grammar, other=-1), -1),
             mask=admitted)
    tl.store(wait + s, tl.where(with_grammar, tl.load(ready_wait + s, mask=with_grammar, other=-1), -1),
             mask=admitted)
    tl.store(ready + s, tl.full((BLOCK_S,), TAKEN, tl.int32), mask=with_grammar)


def mask(logits: torch.Tensor, row_slot: torch.Tensor, state: torch.Tensor, wait: torch.Tensor, base: torch.Tensor,
         arena: torch.Tensor) -> None:
    """In place: logits [R, V] (rows sampling for row_slot [R]) at -inf where their slot's grammar says no."""
    rows, vocab = logits.shape
    _mask[(rows,)](logits, logits.stride(0), row_slot, state, wait, base, arena, vocab, STATE_WORDS=STATE_WORDS,
                   HEADER_WORDS=HEADER_WORDS, BLOCK_V=min(4096, triton.next_power_of_2(vocab)))


def advance(token: torch.Tensor, finish: torch.Tensor, state: torch.Tensor, wait: torch.Tensor, base: torch.Tensor,
            arena: torch.Tensor) -> None:
    """token, finish: [S], a step's output (token -1 where a slot committed none)."""
    _advance[(state.shape[0],)](token, finish, state, wait, base, arena, STATE_WORDS=STATE_WORDS,
                                HEADER_WORDS=HEADER_WORDS)


def land(admit: torch.Tensor, ready: torch.Tensor, ready_base: torch.Tensor, ready_start: torch.Tensor,
         ready_wait: torch.Tensor, base: torch.Tensor, state: torch.Tensor, wait: torch.Tensor) -> None:
    S = state.shape[0]
    _land[(1,)](admit, ready, ready_base, ready_start, ready_wait, base, state, wait, S,
                BLOCK_S=triton.next_power_of_2(S))
