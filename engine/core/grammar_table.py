"""Structured outputs in the device modes, the host's part: a request's grammar lowered, once, into a token-level
finite automaton laid out as one block of int32 words the device walks (blink.engine.kernels.grammar).

outlines-core builds the automaton (its `Index`: per state, the tokens allowed and the state each leads to) from the
regex blink.shared.grammar_backends.device_regex gives for the spec; the vocabulary's bytes come from llguidance's
tokenizer, the one the host mode and the ingress mask and check with. A block's layout, every offset relative to the
block's first word, so a block can land anywhere in the device's arena:

    [T]           its transitions' count (a transition's next state lies T words after its token)
    [states x 3]  per state: its mask's offset, its first transition, one past its last
    [masks x W]   the distinct allowed-token bitmasks (W = ceil(V / 32) words; bit b of word w: token 32w + b)
    [tokens]      per state, the tokens it allows, sorted (the end-of-sequence tokens where the grammar is complete)
    [next]        the state each of those tokens leads to (a state ending on end-of-sequence leads to itself)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from blink.shared.grammar import GrammarError, GrammarSpec
from blink.shared.grammar_backends import check_stop_ids, device_regex

# Where a regex's text ends, a character no answer needs, matched by a token past the model's vocabulary: the states
# that move on it are where the grammar is complete (the model's tokens spelling it lead nowhere final, so are cut).
END_MARK, END_MARK_BYTES = r"\x{10FFFF}", chr(0x10FFFF).encode()
HEADER_WORDS = 1  # a block's first words: its transitions' count
STATE_WORDS = 3  # a state's words in a block: mask offset, first transition, end of its transitions


@dataclass(frozen=True)
class GrammarTable:
    """One grammar's block (the layout above) and where its walk starts."""

    words: np.ndarray  # int32
    start: int  # the initial state
    states: int
    masks: int  # distinct masks (the states share the others')

    @property
    def nbytes(self) -> int:
        return self.words.nbytes


class Lowering:
    """Lowers specs for one model's vocabulary. `tokenizer`: the checkpoint's `tokenizers` Tokenizer; `vocab_size`:
    the logits' width; `eos_ids`: what ends a request, allowed where the grammar is complete."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]):
        check_stop_ids(eos_ids)
        self.vocab_size, self.eos_ids = vocab_size, sorted(set(eos_ids))
        self.words_per_mask = (vocab_size + 31) // 32
        self._tokenizer_json = tokenizer.to_str()
        self._vocabulary = None
        self._lock = threading.Lock()

    @property
    def vocabulary(self) -> Any:
        """outlines-core's Vocabulary: each ordinary token's bytes (special tokens never match a grammar's text)."""
        with self._lock:  # made once, by whichever compile thread comes first
            if self._vocabulary is None:
                import llguidance
                import outlines_core

                tok = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids)
                tokens: dict[bytes, list[int]] = {}
                for i in range(min(self.vocab_size, tok.vocab_size)):
                    if i in self.eos_ids or tok.is_special_token(i):
                        continue
                    text = tok.decode_bytes([i])
                    if text:
                        tokens.setdefault(text, []).append(i)
                tokens.setdefault(END_MARK_BYTES, []).append(self.vocab_size)  # a token past the model's
                self._vocabulary = outlines_core.Vocabulary(self.eos_ids[0], tokens)
            return self._vocabulary

    def lower(self, spec: GrammarSpec) -> GrammarTable:
        """The spec's block; GrammarError when it does not lower (not regular, or a regex outlines-core refuses)."""
        regex = device_regex(spec)
        import outlines_core

        try:  # the end marked by the sentinel: outlines-core 0.2.14 drops a final state's moves to non-final ones
            index = outlines_core.Index(f"(?:{regex}){END_MARK}", self.vocabulary)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the {'regex' if spec.kind == 2 else 'spec'} cannot be walked on the device (graph "
                               f"and persistent drive modes): {str(e).splitlines()[0][:200]}") from None
        transitions = index.get_transitions()
        finals = set(index.get_final_states())  # (the mark may also be text inside the regex: a JSON string's)
        ends = {state for state, moves in transitions.items() if moves.get(self.vocab_size) in finals}
        return self.layout(index.get_initial_state(), transitions, ends)

    def layout(self, start: Any, transitions: dict[Any, dict[int, Any]], finals: Any) -> GrammarTable:
        """The block of an automaton given as {state: {token: next state}}, with its start and final states (any
        hashable names): the model's tokens' moves (not the end tokens') into states from which a final one can be
        reached, the states renumbered from 0 as the start reaches them, the end-of-sequence tokens allowed where
        it is final."""
        finals = set(finals)
        real = {state: {t: s for t, s in moves.items() if 0 <= t < self.vocab_size and t not in self.eos_ids}
                for state, moves in transitions.items()}
        before: dict[Any, set] = {}
        for state, moves in real.items():
            for s in moves.values():
                before.setdefault(s, set()).add(state)
        live, todo = set(finals), list(finals)  # the states a final one can be reached from
        while todo:
            for state in before.get(todo.pop(), ()):
                if state not in live:
                    live.add(state)
                    todo.append(state)
        if start not in live:
            raise GrammarError("the grammar matches no text this model's tokens can spell")
        names, todo = {start: 0}, [start]
        while todo:  # numbered as the start reaches them
            for s in real.get(todo.pop(), {}).values():
                if s in live and s not in names:
                    names[s] = len(names)
                    todo.append(s)
        n, W = len(names), self.words_per_mask
        rows: list[tuple[np.ndarray, np.ndarray]] = [None] * n  # per state: sorted tokens, their next states
        for state, number in names.items():
            moves = {t: names[s] for t, s in real.get(state, {}).items() if s in live}
            if state in finals:
                moves.update(dict.fromkeys(self.eos_ids, number))
            tokens = np.array(sorted(moves), dtype=np.int64)
            rows[number] = (tokens, np.array([moves[t] for t in tokens.tolist()], dtype=np.int64))
        masks: dict[bytes, int] = {}
        mask_rows: list[np.ndarray] = []
        mask_of = np.empty(n, dtype=np.int64)
        for number, (tokens, _) in enumerate(rows):
            bits = np.zeros(W * 32, dtype=np.uint8)
            bits[tokens] = 1
            words = np.packbits(bits, bitorder="little").view(np.int32)
            mask_of[number] = masks.setdefault(words.tobytes(), len(masks))
            if mask_of[number] == len(mask_rows):
                mask_rows.append(words)
        counts = np.array([tokens.size for tokens, _ in rows], dtype=np.int64)
        total = int(counts.sum())
        masks_at = HEADER_WORDS + STATE_WORDS * n
        tokens_at = masks_at + len(mask_rows) * W
        next_at = tokens_at + total
        size = next_at + total
        if size >= 1 << 31:
            raise GrammarError("the grammar's automaton is too large to walk on the device")
        words = np.empty(size, dtype=np.int32)
        first = tokens_at + np.concatenate([[0], np.cumsum(counts)[:-1]])
        words[0] = total
        header = words[HEADER_WORDS:masks_at].reshape(n, STATE_WORDS)
        header[:, 0] = masks_at + mask_of * W
        header[:, 1] = first
        header[:, 2] = first + counts
        if mask_rows:
            words[masks_at:tokens_at] = np.concatenate(mask_rows)
        if total:
            words[tokens_at:next_at] = np.concatenate([tokens for tokens, _ in rows])
            words[next_at:] = np.concatenate([nxt for _, nxt in rows])
        return GrammarTable(words, 0, n, len(mask_rows))


def walk(table: GrammarTable, state: int, token: int) -> int:
    """The state `token` leads to from `state` in the block, or -1 where the state does not allow it: the device's
    advance (blink.engine.kernels.grammar), on the host, for tests and tools."""
    words = table.words
    begin, end = (int(w) for w in words[state_at(state) + 1:state_at(state) + 3])
    i = begin + int(np.searchsorted(words[begin:end], token))
    return int(words[i + int(words[0])]) if i < end and words[i] == token else -1


def allowed(table: GrammarTable, state: int) -> np.ndarray:
    """The tokens `state` allows, sorted."""
    begin, end = (int(w) for w in table.words[state_at(state) + 1:state_at(state) + 3])
    return table.words[begin:end].astype(np.int64)


def state_at(state: int) -> int:
    """A state's first word in its block."""
    return HEADER_WORDS + STATE_WORDS * state


# The device's walk in torch (the references blink.engine.kernels.grammar is tested against): the arena holds blocks
# at each slot's `base`; a slot's `state` is -1 without a grammar; its `wait`, the token it waits for before its
# grammar starts (-1: none).


def mask_reference(logits: torch.Tensor, row_slot: torch.Tensor, state: torch.Tensor, wait: torch.Tensor,
                   base: torch.Tensor, arena: torch.Tensor) -> None:
    at, block = state[row_slot].long(), base[row_slot]
    live = (at >= 0) & (wait[row_slot] < 0)
    entry = (block + HEADER_WORDS + STATE_WORDS * at.clamp(min=0)).clamp(max=arena.numel() - 1)
    mask_at = torch.where(live, block + arena[entry].long(), 0)
    v = torch.arange(logits.shape[1], device=logits.device)
    words = arena[(mask_at[:, None] + v[None, :] // 32).clamp(max=arena.numel() - 1)]
    refused = ((words >> (v % 32).to(words.dtype)) & 1) == 0
    logits.masked_fill_(live[:, None] & refused, float("-inf"))


def advance_reference(token: torch.Tensor, finish: torch.Tensor, state: torch.Tensor, wait: torch.Tensor,
                      base: torch.Tensor, arena: torch.Tensor) -> None:
    words = arena.cpu().numpy()
    for s, (at, t, done, block) in enumerate(zip(state.tolist(), token.tolist(), finish.tolist(), base.tolist(),
                                                 strict=True)):
        if at < 0 or (not done and t < 0):
            continue
        if done:
            state[s] = -1
            continue
        if wait[s] >= 0:
            if t == wait[s]:
                wait[s] = -1
            continue
        entry = block + state_at(at)
        begin, end = block + int(words[entry + 1]), block + int(words[entry + 2])
        i = begin + int(np.searchsorted(words[begin:end], t))
        state[s] = int(words[i + int(words[block])]) if i < end and words[i] == t else -1
