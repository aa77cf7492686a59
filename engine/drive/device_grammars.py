"""Structured outputs in the device modes: the grammar arena the device walks, and the host's gate in front of it.

Host work per request, none per token. A constrained record waits, SUBMITTED, until the host has lowered its grammar
(blink.engine.core.grammar_table, on compile threads, cached by spec), put the block in the arena and written where it
lies into words the device reads; only then does the device's admission (blink.engine.kernels.exchange._select) take it.
`poll` does that, from a thread of its own in the graph and persistent modes (the persistent loop has no host thread of
its own), woken by each lowering that completes and otherwise every POLL_S, and ends a record whose grammar does not
lower, or is larger than the whole arena, with an abort and a logged reason. A block is shared by the requests of one
spec and freed once the last of them has left the table. On the device, each step lands the admitted slots' first
states, masks the constrained rows (`mask`, the Step.grammar hook) and advances each state by the committed token, in
three small kernels (blink.engine.kernels.grammar) that leave unconstrained rows alone. A record with a reasoning_end_id
(a thinking model's `</think>`) lands waiting for that token: unmasked, its state unmoved, until it draws it.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from blink.engine.core.grammar import ENDED_REASONS
from blink.engine.core.grammar_table import GrammarTable, Lowering
from blink.engine.drive.table_memory import device_alias
from blink.engine.kernels import grammar as kernels
from blink.shared.grammar import ANY_OBJECT, GrammarCompiler, GrammarError, GrammarSpec
from blink.shared.grammar_backends import GRAMMAR_ARENA_BYTES
from blink.shared.slot_table import Finish, SlotState, SlotTable, grammar_of

log = logging.getLogger(__name__)

READY, TAKEN = 1, 2  # a slot's ready word: its block is in the arena; the device admitted its request with it
# The gate's poll when nothing wakes it: records arrive in shared memory from the ingress's process (or by RDMA, with
# no CPU at all), which signals no thread here; a lowering that completes wakes it at once.
POLL_S = 1e-3
CACHED_TABLES = 32  # lowered specs kept (by spec, the least used evicted) beside the arena; json_object's pinned


class Arena:
    """First-fit ranges of `words` int32 words: where each block lies."""

    def __init__(self, words: int):
        self.words = words
        self._free: list[tuple[int, int]] = [(0, words)]  # (start, size), by start
        self.used = 0  # words taken: read by the engine's status thread, which must not walk _free as it changes

    def take(self, size: int) -> int | None:
        for i, (start, room) in enumerate(self._free):
            if room >= size:
                self._free[i:i + 1] = [(start + size, room - size)] if room > size else []
                self.used += size
                return start
        return None

    def give(self, start: int, size: int) -> None:
        self.used -= size
        i = bisect.bisect(self._free, (start, size))
        self._free.insert(i, (start, size))
        merged: list[tuple[int, int]] = []
        for s, n in self._free:  # neighbours coalesce
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged

    @property
    def free_words(self) -> int:
        return sum(n for _, n in self._free)


class DeviceGrammars:
    """The grammar walk's state for one device step. `arena_bytes` (--grammar-arena-bytes): every resident block
    together (a grammar larger than the whole arena is refused; one that does not fit beside the others waits)."""

    def __init__(self, engine: Any, table: SlotTable, arena_bytes: int = GRAMMAR_ARENA_BYTES):
        device, S = engine.device, engine.state.num_slots
        pinned = device.type == "cuda"
        self.table, self.device = table, device
        words = max(1, arena_bytes // 4) if table.geometry.max_grammar_bytes else 1
        self.arena = torch.zeros(words, dtype=torch.int32, device=device)
        self.space = Arena(words)
        self.state = torch.full((S,), -1, dtype=torch.int32, device=device)  # per slot; -1: no grammar
        self.base = torch.zeros(S, dtype=torch.int64, device=device)  # per slot: its block's first word
        self.wait = torch.full((S,), -1, dtype=torch.int32, device=device)  # per slot: the token its grammar awaits
        # Host words the device reads in place: a block's place for a submitted slot, and whether it is ready.
        self.ready = torch.zeros(S, dtype=torch.int32, pin_memory=pinned)
        self.ready_base = torch.zeros(S, dtype=torch.int64, pin_memory=pinned)
        self.ready_start = torch.zeros(S, dtype=torch.int32, pin_memory=pinned)
        self.ready_wait = torch.full((S,), -1, dtype=torch.int32, pin_memory=pinned)  # the record's reasoning_end_id
        self.device_ready, self._device_base, self._device_start, self._device_wait = (
            device_alias(t, device) for t in (self.ready, self.ready_base, self.ready_start, self.ready_wait))
        self._tokenizer, self._vocab = engine.tokenizer.raw, engine.model_config.vocab_size
        self._eos = list(engine.generation.eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        # Blocks in the arena, one per spec whatever the requests that walk it (the same schema sent by many clients,
        # or a JSON object's 27 MB table, lands once): spec -> (first word, words, the slots holding it).
        self.blocks: dict[GrammarSpec, tuple[int, int, set[int]]] = {}
        self.held: dict[int, GrammarSpec] = {}  # slot -> the spec of the block it holds
        self.pending: dict[int, tuple[GrammarSpec, Future, float]] = {}  # slot -> its spec's compile, since when
        self.ended = dict.fromkeys(ENDED_REASONS, 0)  # records ended because their grammar could not be walked
        self._copies = torch.cuda.Stream(device) if pinned else None
        self._stop = threading.Event()
        self._wake = threading.Event()  # a lowering completed (or stop): poll now
        self._thread: threading.Thread | None = None

    # The device's side: kernels in every step (captured; no branch on what is resident).

    def land(self, admit: torch.Tensor) -> None:
        kernels.land(admit, self.device_ready, self._device_base, self._device_start, self._device_wait, self.base,
                     self.state, self.wait)

    def mask(self, logits: torch.Tensor, slot: torch.Tensor) -> None:
        """Step.grammar's hook: before sampling, each constrained row's logits -inf where its state says no."""
        kernels.mask(logits, slot, self.state, self.wait, self.base, self.arena)

    def advance(self, token: torch.Tensor, finish: torch.Tensor) -> None:
        kernels.advance(token, finish, self.state, self.wait, self.base, self.arena)

    # The host's side: the gate.

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            # Fewer tables cached than the host's matchers: a generic JSON object's is 27 MB on a 49k vocabulary.
            self._compiler = GrammarCompiler(_Lowerer(Lowering(self._tokenizer, self._vocab, self._eos)),
                                             cached=CACHED_TABLES)
        return self._compiler

    def arena_usage(self) -> tuple[int, int, int] | None:
        """The arena's bytes in use, its capacity, and the tables resident (/metrics); None while the slot table
        carries no grammar (the arena is a placeholder word)."""
        if not self.table.geometry.max_grammar_bytes:
            return None
        return 4 * self.space.used, 4 * self.space.words, len(self.blocks)

    def poll(self) -> bool:
        """Frees the blocks of requests that left, readies the submitted constrained slots whose block is in the
        arena, and ends those whose grammar cannot be walked; True while some still compile or wait for room."""
        slots = self.table.slots
        # The ready words before the states: the device writes ADMITTED, then TAKEN, so a TAKEN seen here was
        # admitted before the states are read, and a SUBMITTED beside it is a new request, not that one (read the
        # other way round, a request admitted between the two reads would look new and lose its block).
        ready = self.ready.numpy().copy()
        states = slots["state"].copy()
        ours = slots["epoch"] == np.uint32(self.table.header["epoch"])
        submitted = ours & (states == int(SlotState.SUBMITTED))
        for s in list(self.held):
            gone = not ours[s] or states[s] not in (int(SlotState.SUBMITTED), int(SlotState.ADMITTED))
            if gone or (submitted[s] and ready[s] == TAKEN):  # (then a new request, submitted after it ended)
                self._let_go(s)
                ready[s] = 0
        for s in np.flatnonzero(submitted & (slots["grammar_kind"] != 0) & (ready != READY)).tolist():
            self._ready(s, slots[s])
        for s in list(self.pending):
            if not submitted[s]:
                del self.pending[s]
        return bool(self.pending)

    def _ready(self, s: int, record: np.void) -> None:
        try:
            spec = grammar_of(record)
        except ValueError as e:
            self._refuse(s, str(e))
            return
        pending = self.pending.get(s)
        if pending is None or pending[0] != spec:
            try:
                pending = self.pending[s] = (spec, self.compiler.submit(spec), time.monotonic())
            except GrammarError as e:  # a model no grammar can end
                self._refuse(s, str(e))
                return
            pending[1].add_done_callback(lambda _: self._wake.set())
        future = pending[1]
        if not future.done():
            if time.monotonic() - pending[2] > self.compiler.timeout_s:
                self._refuse(s, f"its grammar did not lower within {self.compiler.timeout_s:g} s", "timeout")
            return
        if future.exception() is not None:
            self._refuse(s, str(future.exception()))
            return
        block: GrammarTable = future.result()
        if spec not in self.blocks:
            size = block.words.size
            if size > self.space.words:
                self._refuse(s, f"its grammar's table takes {block.nbytes} bytes; the device's grammar arena holds "
                                f"{4 * self.space.words}")
                return
            start = self.space.take(size)
            if start is None:
                return  # waits, submitted, for the blocks ahead of it to leave
            self._copy(start, block.words)
            self.blocks[spec] = (start, size, set())
        start, _, holders = self.blocks[spec]
        holders.add(s)
        self.held[s] = spec
        self.ready_base[s], self.ready_start[s] = start, block.start
        self.ready_wait[s] = int(record["reasoning_end_id"])  # a thinking model's: masked after its reasoning
        self.ready[s] = READY  # after its place: the device reads this first
        del self.pending[s]

    def _let_go(self, s: int) -> None:
        """The slot's request left: its block leaves the arena with the last slot holding it, and its ready word is
        cleared (a record the device dropped unadmitted leaves it READY, which the slot's next request would land)."""
        self.ready[s] = 0
        spec = self.held.pop(s)
        start, size, holders = self.blocks[spec]
        holders.discard(s)
        if not holders:
            self.space.give(start, size)
            del self.blocks[spec]

    def _copy(self, start: int, words: np.ndarray) -> None:
        source = torch.from_numpy(words)
        if self._copies is None:
            self.arena[start:start + words.size].copy_(source)
            return
        with torch.cuda.stream(self._copies):
            self.arena[start:start + words.size].copy_(source)
        self._copies.synchronize()  # in the arena before the slot is ready

    def _refuse(self, s: int, why: str, reason: str = "failed") -> None:
        log.warning("slot %d's structured output cannot be served in this drive mode: %s", s, why)
        self.pending.pop(s, None)
        self.ended[reason] += 1
        self.table.admit(s)
        self.table.finish(s, Finish.ABORT)

    def start(self) -> None:
        """The gate's thread (no thread while the table carries no grammar)."""
        if self.table.geometry.max_grammar_bytes and self._thread is None:
            # json_object's table, a generic JSON object over the whole vocabulary, takes seconds to lower (12 s on a
            # loaded 2-core VM): lowered once now, so its first request does not wait past the compile limit, and
            # pinned, as lowering it again after CACHED_TABLES other specs evicted it would outlast that limit.
            self.compiler.submit(GrammarSpec.json_schema(ANY_OBJECT), pin=True)
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="grammar-gate", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self._stop.is_set():
            self._wake.clear()  # before the poll: a lowering that completes during it wakes the next wait
            try:
                self.poll()
            except Exception:  # never the engine's end: logged, and polled again
                log.exception("the grammar gate's poll failed")
            self._wake.wait(POLL_S)

    def close(self) -> None:
        self.stop()
        if self._compiler is not None:
            self._compiler.close()


class _Lowerer:
    """A Lowering as GrammarCompiler's backend (it only compiles)."""

    name = "outlines-core"

    def __init__(self, lowering: Lowering):
        self.lower = lowering.lower

    def compile(self, spec: GrammarSpec) -> GrammarTable:
        return self.lower(spec)
