"""The slot table: the one sync point between ingress and engine, as a shared-memory segment.

A header (geometry, engine epoch, heartbeat, engine state) and a fixed array of request slots. Each slot is
a small state machine whose transitions have one owner each:

    FREE --ingress publishes--> SUBMITTED --engine admits--> ADMITTED --engine finishes--> FINISHED
    FINISHED --ingress has read everything--> FREE

The payload is written before the state that publishes it; tokens are written into the slot's output
window before the `produced` counter that publishes them, and the ingress advances `consumed` after
reading, so the engine never overwrites an unread token (it pauses a sequence whose window is full).
Stores from one Python process become visible to another in program order on x86-64 (TSO); the RDMA
transport gets the same ordering from a reliable-connected queue pair. This module imports no torch: the
ingress side must run on a SmartNIC's cores.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

from blink.shared.grammar import GrammarKind, GrammarSpec
from blink.shared.prefix_hash import page_hashes
from blink.shared.request_schema import (
    FIELDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_IDS,
    Request,
    grammar_area,
    record_fields,
)

MAGIC = 0x424C494E4B534C54  # "BLINKSLT"
VERSION = 8  # 6: records carry their prompt's page hashes (prefix caching); 7: a grammar area (structured outputs);
# 8: the token a grammar waits for (reasoning_end_id)
SHM_DIR = Path(os.environ.get("BLINK_SHM_DIR", "/dev/shm"))  # another directory stands for another host in tests


class SlotState(IntEnum):
    FREE = 0
    SUBMITTED = 1
    ADMITTED = 2
    FINISHED = 3


class EngineState(IntEnum):
    STARTING = 0
    READY = 1
    DRAINING = 2
    STOPPED = 3


class Client(IntEnum):
    """Who publishes requests into the table: one kind at a time, since each owns every FREE slot."""

    NONE = 0
    INGRESS = 1  # an ingress on the engine's host, through shared memory (`shm`)
    RELAY = 2  # the engine host's relay, for an ingress that sends over ZeroMQ (`zmq`)


class Finish(IntEnum):
    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    FAILED = 4  # the engine holding the request died: the ingress says so; no engine ever writes it


FINISH_NAMES = {Finish.STOP: "stop", Finish.LENGTH: "length", Finish.ABORT: "abort"}  # OpenAI's finish_reason


@dataclass
class TokenLogprob:
    """A token as read out of a window entry: its logprob (given what came before it) and the k most likely
    tokens there, as (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Geometry:
    num_slots: int
    max_prompt_tokens: int
    window: int  # output tokens a slot buffers before the engine pauses it
    top_logprobs: int = MAX_LOGPROBS
    max_stop_ids: int = MAX_STOP_IDS
    page_size: int = 16  # tokens per KV page: a record holds a hash per full page of its prompt
    prefix_seed: int = 0  # the engine's part of the page hashes (blink.shared.prefix_hash)
    max_grammar_bytes: int = 0  # a record's grammar area (structured outputs); 0: the table carries no grammar

    @property
    def max_page_hashes(self) -> int:
        return self.max_prompt_tokens // self.page_size


_COUNTED = ("preemptions", "pages_out", "pages_in", "bytes_out", "bytes_in", "cached_tokens")

HEADER = np.dtype([
    ("magic", "<u8"), ("version", "<u4"), ("num_slots", "<u4"), ("max_prompt_tokens", "<u4"), ("window", "<u4"),
    ("top_logprobs", "<u4"), ("max_stop_ids", "<u4"), ("engine_state", "<u4"), ("failovers", "<u4"),
    ("epoch", "<u8"), ("steps", "<u8"), ("last_step_ns", "<u8"), ("client", "<u4"),
    ("admission_limit", "<u4"),  # requests the engine admits at once (the control plane's set_limits)
    ("page_size", "<u4"), ("prefix_seed", "<u8"), ("max_grammar_bytes", "<u4"),
], align=True)
NO_LIMIT = 0xFFFFFFFF
HEADER_BYTES = 256


def slot_dtype(g: Geometry) -> np.dtype:
    return np.dtype([
        # Control: state has one owner per transition; cancel is the ingress's.
        ("state", "<u4"), ("seq", "<u4"), ("epoch", "<u4"), ("cancel", "<u4"),
        # The request, written by the ingress before it publishes the slot (blink.shared.request_schema).
        *record_fields(g.max_stop_ids, g.max_page_hashes),
        ("prompt", "<i4", (g.max_prompt_tokens,)), grammar_area(g.max_grammar_bytes),
        # The output window, written by the engine; consumed is the ingress's.
        ("produced", "<u4"), ("consumed", "<u4"), ("finish_reason", "<u4"),
        # What the engine did to the request, written before it finishes the slot.
        ("preemptions", "<u4"), ("pages_out", "<u4"), ("pages_in", "<u4"), ("bytes_out", "<u8"), ("bytes_in", "<u8"),
        ("cached_tokens", "<u4"), ("wait_ms", "<f4"),
        ("tokens", "<i4", (g.window,)), ("logprob", "<f4", (g.window,)),
        ("top_ids", "<i4", (g.window, g.top_logprobs)), ("top_logprobs", "<f4", (g.window, g.top_logprobs)),
    ], align=True)


def window_room(produced, consumed, window: int):
    """Entries a slot's output window has room for, from its `produced` and `consumed` counters (Python ints, or int64
    arrays or tensors): the window's one rule, for every mode; none left pauses the slot. The counters are uint32 and
    wrap, so their difference counts modulo 2**32. The exchange kernel's Triton copy and the persistent loop's CUDA C
    copy are tested against this (tests/engine/test_window_rule.py)."""
    return window - (produced - consumed) % 2**32


@dataclass
class RequestStats:
    """What the engine did to a request: preemptions (rotated out or recomputed), KV pages and bytes rotated to
    host memory and back, and the time it was resident but not scheduled."""

    preemptions: int = 0
    pages_out: int = 0
    pages_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (OpenAI's usage.prompt_tokens_details)
    wait_ms: float = 0.0


@dataclass
class Output:
    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    finish: Finish  # NONE until the slot has finished and every token was read
    stats: RequestStats | None = None  # with the finish


def write_request(record: np.void, request: Request, g: Geometry) -> None:
    """A request's fields into a slot record (of slot_dtype(g)): every field of the schema, the stop ids, the
    prompt."""
    n, stops = len(request.prompt), request.stop_token_ids
    if not 0 < n <= g.max_prompt_tokens:
        raise ValueError(f"prompt of {n} tokens does not fit a slot of {g.max_prompt_tokens}")
    if len(stops) > g.max_stop_ids:
        raise ValueError(f"at most {g.max_stop_ids} stop token ids fit a slot")
    bias = request.logit_bias
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} logit biases fit a slot")
    grammar = request.grammar.encode()
    if len(grammar) > g.max_grammar_bytes or bool(grammar) != bool(request.grammar_kind):
        raise ValueError(f"a grammar of {len(grammar)} bytes (kind {request.grammar_kind}) does not fit a slot's "
                         f"{g.max_grammar_bytes}")
    given = {"prompt_len": n, "num_stop_ids": len(stops), "num_logit_bias": len(bias), "grammar_len": len(grammar)}
    for f in FIELDS:
        record[f.name] = given[f.name] if f.name in given else getattr(request, f.name)
    record["stop_ids"][: len(stops)] = stops
    if bias:
        record["logit_bias_ids"][: len(bias)], record["logit_bias"][: len(bias)] = zip(*bias, strict=True)
    record["prompt"][:n] = request.prompt
    hashes = page_hashes(request.prompt, g.page_size, g.prefix_seed, request.cache_salt)
    record["page_hashes"][: len(hashes)] = hashes
    record["page_hashes"][len(hashes):] = 0
    record["grammar"][: len(grammar)] = np.frombuffer(grammar, dtype=np.uint8)


def grammar_of(record: np.void) -> GrammarSpec | None:
    """The grammar a record carries (structured outputs), or None."""
    kind = int(record["grammar_kind"])
    if kind == GrammarKind.NONE:
        return None
    return GrammarSpec(GrammarKind(kind), record["grammar"][: int(record["grammar_len"])].tobytes().decode())


class SlotTable:
    """A mapped slot table. `create` makes the segment (mode 0600); `attach` maps an existing one."""

    def __init__(self, path: Path, mapping: mmap.mmap, geometry: Geometry, inode: int | None = None):
        """inode: the file's, mapped from `path` (None: memory of another kind, a replica)."""
        self.path, self.geometry, self._map, self._inode = path, geometry, mapping, inode
        self.header = np.ndarray((), dtype=HEADER, buffer=mapping, offset=0)
        self.slots = np.ndarray((geometry.num_slots,), dtype=slot_dtype(geometry), buffer=mapping,
                                offset=HEADER_BYTES)

    @staticmethod
    def path_for(name: str) -> Path:
        if not name or "/" in name:
            raise ValueError(f"invalid slot table name {name!r}")
        return SHM_DIR / f"blink-{name}"

    @staticmethod
    def size_for(geometry: Geometry) -> int:
        return HEADER_BYTES + geometry.num_slots * slot_dtype(geometry).itemsize

    @classmethod
    def create(cls, name: str, geometry: Geometry, epoch: int = 1) -> SlotTable:
        path = cls.path_for(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            size = cls.size_for(geometry)
            os.ftruncate(fd, size)
            table = cls(path, mmap.mmap(fd, size), geometry, os.fstat(fd).st_ino)
        finally:
            os.close(fd)
        h = table.header
        for field, value in (("version", VERSION), ("num_slots", geometry.num_slots),
                             ("max_prompt_tokens", geometry.max_prompt_tokens), ("window", geometry.window),
                             ("top_logprobs", geometry.top_logprobs), ("max_stop_ids", geometry.max_stop_ids),
                             ("page_size", geometry.page_size), ("prefix_seed", geometry.prefix_seed),
                             ("max_grammar_bytes", geometry.max_grammar_bytes),
                             ("epoch", epoch), ("engine_state", EngineState.STARTING),
                             ("admission_limit", NO_LIMIT)):
            h[field] = value
        h["magic"] = MAGIC  # last: an attacher that sees the magic sees the geometry
        return table

    @classmethod
    def attach(cls, name: str) -> SlotTable:
        path = cls.path_for(name)
        fd = os.open(path, os.O_RDWR)
        try:
            size, inode = os.fstat(fd).st_size, os.fstat(fd).st_ino
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        h = np.ndarray((), dtype=HEADER, buffer=mapping, offset=0)
        if int(h["magic"]) != MAGIC or int(h["version"]) != VERSION:
            raise ValueError(f"{path} is not a version-{VERSION} Blink slot table")
        geometry = Geometry(int(h["num_slots"]), int(h["max_prompt_tokens"]), int(h["window"]),
                            int(h["top_logprobs"]), int(h["max_stop_ids"]), int(h["page_size"]), int(h["prefix_seed"]),
                            int(h["max_grammar_bytes"]))
        if size != cls.size_for(geometry):
            raise ValueError(f"{path} is {size} bytes, its header describes {cls.size_for(geometry)}")
        return cls(path, mapping, geometry, inode)

    transport = "shm"  # how the ingress reaches this table: it maps the engine's memory

    @property
    def mapping(self) -> mmap.mmap:
        """The table's memory (the rdma transport registers it with the NIC)."""
        return self._map

    def close(self) -> None:
        del self.header, self.slots
        self._map.close()

    def unlink(self) -> None:
        if not self.replaced():  # never another engine's table
            self.path.unlink(missing_ok=True)

    def replaced(self) -> bool:
        """Whether another table is at this one's path now: an engine that restarted with another geometry (a
        context limit fitted to the memory it found free) made a new one, which whoever maps this one must attach
        to reach it."""
        if self._inode is None:
            return False
        try:
            return self.path.stat().st_ino != self._inode
        except FileNotFoundError:
            return False

    # -- the ingress's side ------------------------------------------------------------------------------

    def publish(self, slot: int, request: Request) -> int:
        """Writes a request into a FREE slot, then publishes it. Returns the slot's new sequence number."""
        s = self.slots[slot]
        if s["state"] != SlotState.FREE:
            raise RuntimeError(f"slot {slot} is not free")
        write_request(s, request, self.geometry)
        s["produced"] = s["consumed"] = s["cancel"] = s["finish_reason"] = 0
        s["epoch"] = self.header["epoch"]
        seq = (int(s["seq"]) + 1) & 0xFFFFFFFF
        s["seq"] = seq
        s["state"] = SlotState.SUBMITTED  # last
        return seq

    def read(self, slot: int) -> Output:
        """Takes every token the engine has published since the last read, and the finish once all are read."""
        s, window = self.slots[slot], self.geometry.window
        finished = s["state"] == SlotState.FINISHED  # read before `produced`: then no token can follow it
        produced, consumed = int(s["produced"]), int(s["consumed"])
        at = [i % window for i in range(consumed, produced)]
        stats = RequestStats(**{f: int(s[f]) for f in _COUNTED}, wait_ms=float(s["wait_ms"])) if finished else None
        out = Output(s["tokens"][at].tolist(), s["logprob"][at].tolist(), s["top_ids"][at].tolist(),
                     s["top_logprobs"][at].tolist(), Finish(int(s["finish_reason"])) if finished else Finish.NONE,
                     stats)
        s["consumed"] = produced  # after copying: the engine may now reuse those cells
        return out

    def cancel(self, slot: int) -> None:
        self.slots[slot]["cancel"] = 1

    def free(self, slot: int) -> None:
        s = self.slots[slot]
        if s["state"] != SlotState.FINISHED:
            raise RuntimeError(f"slot {slot} has not finished")
        s["state"] = SlotState.FREE

    def orphaned(self, slot: int) -> bool:
        """Whether no engine will ever finish this slot: published or admitted under an older epoch."""
        s = self.slots[slot]
        return s["state"] in (SlotState.SUBMITTED, SlotState.ADMITTED) and s["epoch"] != self.header["epoch"]

    def reclaim(self, slot: int) -> None:
        """Frees an orphaned slot: its engine is gone, so nobody else writes it."""
        if not self.orphaned(slot):
            raise RuntimeError(f"slot {slot} still belongs to a live engine")
        self.slots[slot]["state"] = SlotState.FREE

    def resubmit(self, slot: int) -> None:
        """Moves a request that no engine admitted to the current epoch, for the engine that took over."""
        s = self.slots[slot]
        if s["state"] != SlotState.SUBMITTED:
            raise RuntimeError(f"slot {slot} is not waiting for admission")
        s["epoch"] = self.header["epoch"]

    def claim(self, client: Client, force: bool = False) -> None:
        """Makes `client` the table's publisher; another kind already publishing is an error, unless `force`d (it
        handed its requests over but could not release the table). A restarted client of the same kind takes
        over: its predecessor's slots are orphans."""
        current = Client(int(self.header["client"]))
        if current not in (Client.NONE, client) and not force:
            raise RuntimeError(f"slot table {self.path} is fed by the {current.name.lower()}, not the "
                               f"{client.name.lower()}: one transport per deployment")
        self.header["client"] = client

    def release_client(self, client: Client) -> None:
        """A stopping client gives up its claim: another kind of publisher may take over."""
        if int(self.header["client"]) == client:
            self.header["client"] = Client.NONE

    # -- what a replica of the table (blink.shared.replica_table) pulls; here the table is the memory itself ----

    def refresh_header(self) -> None:
        """Nothing to do: this mapping is the engine's memory."""

    def refresh(self, slots: list[int]) -> None:
        """Nothing to do: this mapping is the engine's memory."""

    def heartbeat_age_s(self) -> float:
        return (time.monotonic_ns() - int(self.header["last_step_ns"])) / 1e9

    def admission_limit(self) -> int | None:
        limit = int(self.header["admission_limit"])
        return None if limit == NO_LIMIT else limit

    # -- the watchdog's side -----------------------------------------------------------------------------

    def remove_if_abandoned(self) -> None:
        """Removes the segment once its engine has stopped and no ingress maps it (the relay lives in the engine):
        whichever of the two leaves last calls this and does it."""
        if (int(self.header["engine_state"]) == EngineState.STOPPED
                and int(self.header["client"]) != Client.INGRESS):
            self.unlink()

    def fail_over(self, failed: bool = True) -> int:
        """Declares the current engine gone (`failed`: it died, rather than stopped when told): a new epoch, which
        no slot of the old one belongs to."""
        self.header["engine_state"] = EngineState.STOPPED
        self.header["failovers"] = int(self.header["failovers"]) + int(failed)
        self.header["epoch"] = int(self.header["epoch"]) + 1
        return int(self.header["epoch"])

    # -- the engine's side -------------------------------------------------------------------------------

    def take_over(self) -> None:
        """A new engine's start on a table a dead one left: a new epoch, and a heartbeat of its own."""
        self.header["engine_state"] = EngineState.STARTING
        self.header["epoch"] = int(self.header["epoch"]) + 1
        self.set_admission_limit(None)  # a new engine admits as many as it has slots
        self.heartbeat()

    def set_admission_limit(self, limit: int | None) -> None:
        self.header["admission_limit"] = NO_LIMIT if limit is None else limit

    def submitted(self) -> np.ndarray:
        """Slots published under the current epoch and not yet admitted."""
        states, epochs = self.slots["state"], self.slots["epoch"]
        return np.flatnonzero((states == int(SlotState.SUBMITTED)) & (epochs == np.uint32(self.header["epoch"])))

    def admit(self, slot: int) -> None:
        self.slots[slot]["state"] = SlotState.ADMITTED

    def room(self, slot: int) -> int:
        """Tokens the engine may still write before the ingress reads some."""
        s = self.slots[slot]
        return window_room(int(s["produced"]), int(s["consumed"]), self.geometry.window)

    def emit(self, slot: int, token: int, logprob: float = 0.0, top_ids: list[int] | None = None,
             top_logprobs: list[float] | None = None) -> None:
        s = self.slots[slot]
        produced = int(s["produced"])
        if window_room(produced, int(s["consumed"]), self.geometry.window) <= 0:
            raise RuntimeError(f"slot {slot}'s output window is full")
        i = produced % self.geometry.window
        s["tokens"][i], s["logprob"][i] = token, logprob
        if top_ids is not None:
            k = len(top_ids)
            s["top_ids"][i, :k], s["top_logprobs"][i, :k] = top_ids, top_logprobs
        s["produced"] = produced + 1  # after the record: publishes it

    def finish(self, slot: int, reason: Finish, stats: RequestStats | None = None) -> None:
        s = self.slots[slot]
        stats = stats or RequestStats()
        for field in (*_COUNTED, "wait_ms"):
            s[field] = getattr(stats, field)
        s["finish_reason"] = reason
        s["state"] = SlotState.FINISHED  # after every token and the reason

    def heartbeat(self) -> None:
        self.stamp()
        self.header["steps"] = int(self.header["steps"]) + 1

    def stamp(self) -> None:
        """The host vouches the engine is alive (in the device modes the device counts the steps itself)."""
        self.header["last_step_ns"] = time.monotonic_ns()
