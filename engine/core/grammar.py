"""Structured outputs in the host mode: a grammar matcher per constrained slot, its mask on the step's logits.

As vLLM does it: the engine compiles each request's grammar (blink.shared.grammar, cached by spec, on worker threads),
keeps a matcher per constrained slot, fills the bitmask of the constrained rows before sampling (`mask`, which
`Step.run` calls) and advances each matcher with the token its slot committed (`advance`, from the host's events).
Rows without a grammar pay nothing, and a step with no constrained slot resident does no mask work at all. A record
with a `reasoning_end_id` (a thinking model's `</think>`, which the ingress's reasoning parser sets) is unmasked until
it draws that token, as vLLM masks from the end of the reasoning. The device modes do not call this: they walk a token
automaton on the device (blink.engine.drive.device_grammars).
"""

from __future__ import annotations

import logging
import time
import weakref
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from blink.shared.grammar import Backend, GrammarCompiler, GrammarError
from blink.shared.grammar_backends import BACKENDS, DEFAULT_BACKEND, MAX_WHITESPACE, check_stop_ids, guidance
from blink.shared.slot_table import grammar_of

log = logging.getLogger(__name__)

# Why the engine ended a constrained record (blink:structured_output_engine_ended's reasons, in every drive mode): its
# grammar failed to compile or lower there (or did not fit), or its compile outlasted the time limit.
ENDED_REASONS = ("failed", "timeout")


def make_backend(name: str, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> Backend:
    """The engine's grammar library `name` (blink.shared.grammar_backends.guidance says what the arguments are);
    ImportError when it is not installed."""
    if name not in BACKENDS:
        raise ValueError(f"unknown structured-outputs backend {name!r}; one of {', '.join(BACKENDS)}")
    if name == "guidance":
        return guidance(tokenizer, vocab_size, stop_ids)
    from blink.engine.core.xgrammar_backend import XGrammar

    check_stop_ids(stop_ids)
    return XGrammar(tokenizer, vocab_size, list(stop_ids), MAX_WHITESPACE)


class SlotGrammars:
    """The engine's constrained slots. `tokenizer`: the checkpoint's `tokenizers` Tokenizer; `vocab_size`: the
    logits' width; `eos_ids`: what ends a request (the matcher allows them once the grammar is complete); `backend`:
    the library it masks with (blink.shared.grammar_backends.BACKENDS; the ingress checks with llguidance)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int], backend: str = DEFAULT_BACKEND):
        self._tokenizer, self.vocab_size, self.eos_ids, self.backend = tokenizer, vocab_size, list(eos_ids), backend
        self._compiler: GrammarCompiler | None = None
        self.matchers: dict[int, Any] = {}  # constrained slot -> its matcher
        # Constrained slot -> the token it waits for (a thinking model's end of reasoning): unmasked until it comes.
        self.waiting: dict[int, int] = {}
        self._bitmask: np.ndarray | None = None  # [rows, ceil(V / 32)] int32, reused
        # Compiles slots wait for -> since when (gone with the compiler's cache entry).
        self._waiting: weakref.WeakKeyDictionary[Future, float] = weakref.WeakKeyDictionary()
        self.ended = dict.fromkeys(ENDED_REASONS, 0)  # records ended because their grammar could not be served

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:  # the library only once a grammar comes
            try:
                backend = make_backend(self.backend, self._tokenizer, self.vocab_size, self.eos_ids)
            except ImportError as e:  # the request is refused, never the engine's loop ended
                package = "llguidance" if self.backend == "guidance" else "xgrammar"
                raise GrammarError(f"--structured-outputs-backend {self.backend} needs {package} beside the engine "
                                   f"({e})") from None
            self._compiler = GrammarCompiler(backend)
        return self._compiler

    def ready(self, records: np.ndarray, slots: list[int]) -> tuple[list[int], list[int]]:
        """Of submitted `slots` (records indexed by slot): those that may be admitted now (no grammar, or compiled)
        and those whose grammar cannot be served; the others' compiles are started, and they wait, unadmitted, so a
        compile never holds a step up."""
        ready, failed = [], []
        for slot in slots:
            future = self._compile(records[slot])
            if future is None or (future.done() and future.exception() is None):
                ready.append(slot)
            elif future.done():
                log.warning("slot %d's grammar cannot be served: %s", slot, future.exception())
                failed.append(slot)
                self.ended["failed"] += 1
            elif time.monotonic() - self._waiting.setdefault(future, time.monotonic()) > self.compiler.timeout_s:
                log.warning("slot %d's grammar did not compile within %g s", slot, self.compiler.timeout_s)
                failed.append(slot)  # the ingress's compile of it took less: never wait on it for ever
                self.ended["timeout"] += 1
        return ready, failed

    def admit(self, records: np.ndarray, slots: list[int]) -> list[int]:
        """A matcher for each admitted slot whose record carries a grammar (compiled now where `ready` did not);
        returns the slots whose grammar failed, which the caller ends."""
        failed = []
        for slot in slots:
            try:
                spec = grammar_of(records[slot])
                if spec is not None:
                    self.matchers[slot] = self.compiler.backend.matcher(self.compiler.compile(spec))
                    if (end := int(records[slot]["reasoning_end_id"])) >= 0:
                        self.waiting[slot] = end
            except (GrammarError, ValueError) as e:
                log.warning("slot %d's grammar cannot be served: %s", slot, e)
                failed.append(slot)
                self.ended["failed"] += 1
        return failed

    def _compile(self, record: np.void) -> Future | None:
        try:
            spec = grammar_of(record)
            return None if spec is None else self.compiler.submit(spec)
        except ValueError as e:  # a kind or text no edge wrote, or a model no grammar can end (GrammarError)
            future: Future = Future()
            future.set_exception(GrammarError(str(e)))
            return future

    def mask(self, logits: torch.Tensor, slot: torch.Tensor) -> None:
        """In place: each constrained row's logits outside what its grammar allows next are -inf. logits: [R, V];
        slot: [R], the slot each row samples for. Nothing at all when no constrained slot is resident."""
        if not self.matchers:
            return
        slots = slot.tolist()
        rows, filled = [], {}
        bitmask, backend = self._rows(len(slots)), self.compiler.backend
        for row, s in enumerate(slots):
            matcher = self.matchers.get(s)
            if matcher is None or s in self.waiting:
                continue
            if s in filled:  # a padding row of the same slot: its copy
                bitmask[row] = bitmask[filled[s]]
            else:
                backend.fill(matcher, bitmask, row)
                filled[s] = row
            rows.append(row)
        if rows:
            self._apply(logits, bitmask, rows)

    def _apply(self, logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
        """-inf where a row's bit is 0: the words unpacked to a flag per token on the host (bit b of a little-endian
        word is its first byte's bit b), filled in there on the CPU, else on the logits' device."""
        refused = np.unpackbits(bitmask[rows].view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]] == 0
        if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float16):
            values = logits.numpy()  # the same memory: numpy fills on this thread (torch's would wake its pool)
            for i, row in enumerate(rows):
                np.putmask(values[row], refused[i], -np.inf)
            return
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(torch.from_numpy(refused).to(logits.device), float("-inf"))

    def _rows(self, n: int) -> np.ndarray:
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = np.full((n, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        return self._bitmask

    def advance(self, slot: int, token: int) -> None:
        """The slot committed `token`: its matcher moves on. A token the grammar refuses (only a request mixing a
        grammar with what overrides it could draw one) frees the slot of its grammar, logged."""
        if self.waiting.get(slot, token) != token:  # still reasoning: the grammar starts after its end token
            return
        if self.waiting.pop(slot, None) is not None:  # the end token itself is the reasoning's, not the answer's
            return
        matcher = self.matchers.get(slot)
        if matcher is not None and not self.compiler.backend.accept(matcher, token):
            log.error("slot %d drew token %d, which its grammar refuses; the rest of it is unconstrained", slot, token)
            del self.matchers[slot]

    def release(self, slot: int) -> None:
        self.matchers.pop(slot, None)
        self.waiting.pop(slot, None)
