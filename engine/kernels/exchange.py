"""The device's side of the slot table: admission from it and publication into it, as Triton kernels.

The table is host memory the device reads and writes directly (mapped; see blink.engine.drive.table_memory), passed as
one byte tensor with the field offsets beside it. The ingress publishes a request by writing its state word last;
the device reads state words with system-scope acquire loads, so the payload it reads next is complete. It writes
a token into the output window, then releases `produced` at system scope, so the ingress never sees a counter
ahead of its record; the finish reason and stats likewise go before the FINISHED state. Under the interpreter
(the CPU, in tests) plain loads and stores stand in for them: Python runs each store in order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from blink.engine.core.admission import span
from blink.engine.core.state import SlotStatus
from blink.shared.slot_table import HEADER, HEADER_BYTES, Finish, Geometry, SlotState, slot_dtype

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Record fields the kernels touch, in the order of the offsets tensor; K_* name their indices. The request's own
# fields are not among them: the admit kernel copies their bytes whole and blink.engine.core.admission lands them.
FIELDS = ("state", "epoch", "cancel", "prompt_len", "logprobs", "prompt_logprobs", "prompt", "produced", "consumed",
          "finish_reason", "preemptions", "pages_out", "pages_in", "bytes_out", "bytes_in", "cached_tokens", "wait_ms",
          "tokens", "logprob", "top_ids", "top_logprobs", "grammar_kind")
(K_STATE, K_EPOCH, K_CANCEL, K_PROMPT_LEN, K_LOGPROBS, K_PROMPT_LOGPROBS, K_PROMPT, K_PRODUCED, K_CONSUMED, K_FINISH,
 K_PREEMPTIONS, K_PAGES_OUT, K_PAGES_IN, K_BYTES_OUT, K_BYTES_IN, K_CACHED_TOKENS, K_WAIT_MS, K_TOKENS, K_LOGPROB,
 K_TOP_IDS, K_TOP_LOGPROBS, K_GRAMMAR_KIND) = (tl.constexpr(i) for i in range(len(FIELDS)))
GRAMMAR_READY = tl.constexpr(1)  # blink.engine.drive.device_grammars.READY

ENGINE_FREE = tl.constexpr(int(SlotStatus.FREE))  # the engine's slot status, beside the table's states
SUBMITTED = tl.constexpr(int(SlotState.SUBMITTED))
ADMITTED = tl.constexpr(int(SlotState.ADMITTED))
FINISHED = tl.constexpr(int(SlotState.FINISHED))
ABORT = tl.constexpr(int(Finish.ABORT))
RECORDS_AT = tl.constexpr(HEADER_BYTES)  # the first record's byte offset


def field_offsets(geometry: Geometry, device: torch.device) -> torch.Tensor:
    fields = slot_dtype(geometry).fields
    return torch.tensor([fields[name][1] for name in FIELDS], dtype=torch.int64, device=device)


def header_offset(name: str) -> int:
    return HEADER.fields[name][1]


@triton.jit
def _field(record, offsets, k: tl.constexpr, dtype: tl.constexpr):
    return (record + tl.load(offsets + k)).to(tl.pointer_type(dtype))


@triton.jit
def _load_acquire(ptr, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.load(ptr, volatile=True)
    else:
        return tl.inline_asm_elementwise("ld.acquire.sys.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.uint32,
                                         is_pure=False, pack=1)


@triton.jit
def _store_release(ptr, value, INTERPRET: tl.constexpr):
    if INTERPRET:
        tl.store(ptr, value)
    else:
        # One thread stores (inline asm runs in every thread, unlike tl.store): a straggling warp's copy of FINISHED
        # could otherwise land after the ingress freed the slot and wrote the next request's state.
        tl.inline_asm_elementwise("{ .reg .pred first; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 first, t, 0; "
                                  "@first st.release.sys.global.u32 [$1], $2; } mov.u32 $0, 0;", "=r,l,r",
                                  [ptr, value], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _room(produced, consumed, WINDOW: tl.constexpr):
    """blink.shared.slot_table.window_room on the uint32 counters, whose difference wraps as they do."""
    return WINDOW - (produced - consumed).to(tl.int64)


@triton.jit
def _select(table, offsets, epoch, status, cancel, paused, window_room, admit, arrival, arrivals, limit, fenced,
            grammar_ready, S, RECORD: tl.constexpr, HEADER_EPOCH: tl.constexpr, WINDOW: tl.constexpr,
            BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr):
    """One program: which published slots to admit (in slot order, up to the running limit; one with a grammar once
    the host put its table in the arena: `grammar_ready`), and each resident slot's cancel flag and window room (and
    whether it has none)."""
    s = tl.arange(0, BLOCK_S)
    real = s < S
    if tl.load((table + HEADER_EPOCH).to(tl.pointer_type(tl.uint64)), volatile=True).to(tl.int64) != tl.load(epoch):
        tl.store(fenced, 1)  # a newer engine owns the table: touch nothing, and admit nothing (not last step's)
        tl.store(admit + s, 0, mask=real)
        return
    record = table + RECORDS_AT + tl.minimum(s, S - 1).to(tl.int64) * RECORD
    states = _load_acquire(_field(record, offsets, K_STATE, tl.uint32), INTERPRET)
    tl.debug_barrier()  # every thread's payload reads come after the acquire
    epochs = tl.load(_field(record, offsets, K_EPOCH, tl.uint32))
    engine = tl.load(status + s, mask=real, other=ENGINE_FREE)
    ours = epochs.to(tl.uint64) == tl.load(epoch).to(tl.uint64)
    wanted = real & (states == SUBMITTED) & ours & (engine == ENGINE_FREE)
    constrained = tl.load(_field(record, offsets, K_GRAMMAR_KIND, tl.uint32)) != 0
    wanted &= ~constrained | (tl.load(grammar_ready + s, mask=real, other=0, volatile=True) == GRAMMAR_READY)
    room = tl.load(limit) - tl.sum((engine != ENGINE_FREE).to(tl.int64))
    rank = tl.cumsum(wanted.to(tl.int64), 0)
    take = wanted & (rank <= room)
    first = tl.load(arrivals)
    tl.store(admit + s, take, mask=real)
    tl.store(arrival + s, first + rank - 1, mask=take)
    tl.store(arrivals, first + tl.sum(take.to(tl.int64)))
    resident = real & (engine != ENGINE_FREE)
    room = _room(tl.load(_field(record, offsets, K_PRODUCED, tl.uint32)),
                 tl.load(_field(record, offsets, K_CONSUMED, tl.uint32), volatile=True), WINDOW)
    tl.store(cancel + s, tl.load(_field(record, offsets, K_CANCEL, tl.uint32), volatile=True) != 0, mask=resident)
    tl.store(paused + s, room <= 0, mask=resident)
    tl.store(window_room + s, room, mask=resident | take)  # an admitted one's too


@triton.jit
def _admit(table, offsets, admit, tokens, tokens_stride, prompt_mask, output_counts, requests,
           SPAN_START: tl.constexpr, SPAN: tl.constexpr, vocab, max_len, MAX_PROMPT: tl.constexpr,
           RECORD: tl.constexpr,
           BLOCK_SPAN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr):
    """One program per slot selected for admission: checks its prompt and copies it into the token history, marks
    its tokens for the penalties (and clears the output counts), copies the request's fields (bytes, whole) into
    `requests` for blink.engine.core.admission, and hands the slot to the engine; an invalid record is ended
    instead (and dropped from `admit`). The bookkeeping is per request: no step walks every slot's vocabulary."""
    s = tl.program_id(0)
    if not tl.load(admit + s):
        return
    row = s.to(tl.int64) * vocab
    start = 0
    while start < vocab:
        v = start + tl.arange(0, BLOCK_V)
        tl.store(prompt_mask + row + v, 0, mask=v < vocab)
        tl.store(output_counts + row + v, 0, mask=v < vocab)
        start += BLOCK_V
    tl.debug_barrier()  # cleared before the prompt's tokens are marked, by whichever thread
    record = table + RECORDS_AT + s.to(tl.int64) * RECORD
    n = tl.load(_field(record, offsets, K_PROMPT_LEN, tl.uint32)).to(tl.int64)
    prompt = _field(record, offsets, K_PROMPT, tl.int32)
    history = tokens + s.to(tl.int64) * tokens_stride
    bad = (n <= 0) | (n >= max_len) | (n > MAX_PROMPT)  # past the record's prompt: read nothing beyond it
    n = tl.minimum(n, MAX_PROMPT)
    start = 0
    while start < n:  # a while loop: the interpreter cannot range() over a loaded value
        j = start + tl.arange(0, BLOCK_P)
        inside = j < n
        t = tl.load(prompt + j, mask=inside, other=0)
        outside = (t < 0) | (t >= vocab)
        bad |= tl.max((outside & inside).to(tl.int32), 0) != 0
        tl.store(history + j, tl.where(outside, 0, t), mask=inside & (j < max_len))  # in range: rows index by it
        tl.store(prompt_mask + row + t, 1, mask=inside & ~outside)
        start += BLOCK_P
    state_word = _field(record, offsets, K_STATE, tl.uint32)
    if bad:  # the ingress validates; a record that still fails is ended, not served
        tl.store(admit + s, False)
        tl.store(_field(record, offsets, K_FINISH, tl.uint32), ABORT)
        tl.debug_barrier()
        _store_release(state_word, tl.full((), FINISHED, tl.uint32), INTERPRET)
        return
    start = 0
    while start < SPAN:  # the span holds a hash per page of the longest prompt: in blocks
        b = start + tl.arange(0, BLOCK_SPAN)
        fields = tl.load(record + SPAN_START + b, mask=b < SPAN, other=0)
        tl.store(requests + s.to(tl.int64) * SPAN + b, fields, mask=b < SPAN)
        start += BLOCK_SPAN
    tl.debug_barrier()
    _store_release(state_word, tl.full((), ADMITTED, tl.uint32), INTERPRET)


@triton.jit
def _put(record, offsets, i, t, lp, top_ids, top_logprobs, k, TOP: tl.constexpr, BLOCK_TOP: tl.constexpr):
    """One entry of the output window (cell i): a token, its logprob and its k top (id, logprob) pairs."""
    tl.store(_field(record, offsets, K_TOKENS, tl.int32) + i, t.to(tl.int32))
    tl.store(_field(record, offsets, K_LOGPROB, tl.float32) + i, lp)
    j = tl.arange(0, BLOCK_TOP)
    wanted = j < k
    ids = tl.load(top_ids + j, mask=wanted, other=0)
    lps = tl.load(top_logprobs + j, mask=wanted, other=0.0)
    tl.store(_field(record, offsets, K_TOP_IDS, tl.int32) + i * TOP + j, ids.to(tl.int32), mask=wanted)
    tl.store(_field(record, offsets, K_TOP_LOGPROBS, tl.float32) + i * TOP + j, lps, mask=wanted)


@triton.jit
def _emit(table, offsets, fenced, token, count, finish, logprob, top_ids, top_logprobs, top_stride, status,
          scored_first, scored_count, scored_token, scored_logprob, scored_top_ids, scored_top_logprobs,
          scored_stride, preemptions, pages_out, pages_in, cached_tokens, wait_s, page_bytes, RECORD: tl.constexpr,
          WINDOW: tl.constexpr, TOP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_TOP: tl.constexpr, RUN: tl.constexpr,
          HEADER_STEPS: tl.constexpr, INTERPRET: tl.constexpr):
    """One program per slot: the prompt tokens it scored, then its tokens (RUN > 1, with drafts: the first `count`
    of its run, in order; else its token, if any), into the output window, then `produced`; its finish, then
    FINISHED."""
    s = tl.program_id(0)
    if tl.load(fenced) != 0:
        return
    if s == 0:  # the engine's own counter: the watchdog sees steps advance
        steps = (table + HEADER_STEPS).to(tl.pointer_type(tl.uint64))
        tl.store(steps, tl.load(steps) + 1)
    record = table + RECORDS_AT + s.to(tl.int64) * RECORD
    emitted = tl.load(count + s) if RUN > 1 else (tl.load(token + s) >= 0).to(tl.int64)
    reason = tl.load(finish + s)
    n = tl.load(scored_count + s)
    if (emitted > 0) | (n > 0):
        produced_word = _field(record, offsets, K_PRODUCED, tl.uint32)
        produced = tl.load(produced_word)
        k = tl.minimum(tl.load(_field(record, offsets, K_PROMPT_LOGPROBS, tl.int32)), WIDTH)
        first = tl.load(scored_first + s)
        e = 0
        while e < n:  # a while loop: the interpreter cannot range() over a loaded value
            row = first + e
            _put(record, offsets, ((produced + e) % WINDOW).to(tl.int64), tl.load(scored_token + row),
                 tl.load(scored_logprob + row), scored_top_ids + row * scored_stride,
                 scored_top_logprobs + row * scored_stride, k, TOP, BLOCK_TOP)
            e += 1
        produced += n.to(tl.uint32)
        k = tl.minimum(tl.load(_field(record, offsets, K_LOGPROBS, tl.int32)), WIDTH)
        e = 0
        while e < emitted:  # the window's room for them was kept by the plan (drafts: state.room - 1)
            i = s * RUN + e
            _put(record, offsets, (produced % WINDOW).to(tl.int64), tl.load(token + i), tl.load(logprob + i),
                 top_ids + i * top_stride, top_logprobs + i * top_stride, k, TOP, BLOCK_TOP)
            produced += 1
            e += 1
        tl.debug_barrier()
        _store_release(produced_word, produced, INTERPRET)
    if reason != 0:
        out_pages = tl.load(pages_out + s)
        in_pages = tl.load(pages_in + s)
        tl.store(_field(record, offsets, K_PREEMPTIONS, tl.uint32), tl.load(preemptions + s).to(tl.uint32))
        tl.store(_field(record, offsets, K_PAGES_OUT, tl.uint32), out_pages.to(tl.uint32))
        tl.store(_field(record, offsets, K_PAGES_IN, tl.uint32), in_pages.to(tl.uint32))
        tl.store(_field(record, offsets, K_BYTES_OUT, tl.uint64), (out_pages * page_bytes).to(tl.uint64))
        tl.store(_field(record, offsets, K_BYTES_IN, tl.uint64), (in_pages * page_bytes).to(tl.uint64))
        tl.store(_field(record, offsets, K_CACHED_TOKENS, tl.uint32), tl.load(cached_tokens + s).to(tl.uint32))
        tl.store(_field(record, offsets, K_WAIT_MS, tl.float32), (tl.load(wait_s + s) * 1000).to(tl.float32))
        tl.store(_field(record, offsets, K_FINISH, tl.uint32), reason.to(tl.uint32))
        tl.debug_barrier()
        _store_release(_field(record, offsets, K_STATE, tl.uint32), tl.full((), FINISHED, tl.uint32), INTERPRET)
        tl.store(status + s, ENGINE_FREE)  # the slot is the ingress's again; the engine forgets it


@dataclass
class DeviceTable:
    """The slot table as the device sees it."""

    memory: torch.Tensor  # uint8, the whole mapping, device-addressable
    offsets: torch.Tensor  # [FIELDS] byte offsets inside a record
    geometry: Geometry

    @classmethod
    def over(cls, memory: torch.Tensor, geometry: Geometry) -> DeviceTable:
        return cls(memory, field_offsets(geometry, memory.device), geometry)

    @property
    def record_bytes(self) -> int:
        return slot_dtype(self.geometry).itemsize


@dataclass
class Inbox:
    """Device buffers the exchange keeps between steps."""

    epoch: torch.Tensor  # [1] int64: the epoch this engine serves
    now: torch.Tensor  # [1] float64: seconds on the host's monotonic clock, for TTFT deadlines
    limit: torch.Tensor  # [1] int64: most requests resident at once (the control plane's admission limit)
    admit: torch.Tensor  # [S] bool: slots admitted this step
    arrival: torch.Tensor  # [S] int64: their arrival numbers
    arrivals: torch.Tensor  # [1] int64: requests admitted so far
    fenced: torch.Tensor  # [1] int32: set once a newer engine's epoch is seen; nothing is written after
    grammar_ready: torch.Tensor  # [S] int32: constrained slots that may be admitted (engine/drive/device_grammars.py)
    requests: torch.Tensor  # [S, span] uint8: the admitted records' request fields (blink.engine.core.admission.span)

    @classmethod
    def create(cls, table: DeviceTable, epoch: int, now: torch.Tensor, limit: torch.Tensor) -> Inbox:
        device, num_slots = now.device, table.geometry.num_slots

        def one(value, dtype):
            return torch.full((1,), value, dtype=dtype, device=device)

        _, span_bytes = span(slot_dtype(table.geometry))
        return cls(one(epoch, torch.int64), now, limit, torch.zeros(num_slots, dtype=torch.bool, device=device),
                   torch.zeros(num_slots, dtype=torch.int64, device=device), one(0, torch.int64), one(0, torch.int32),
                   torch.zeros(num_slots, dtype=torch.int32, device=device),
                   torch.zeros(num_slots, span_bytes, dtype=torch.uint8, device=device))


def take_requests(table: DeviceTable, inbox: Inbox, state, vocab: int, max_len: int) -> None:
    """Takes what the ingress published (up to the limit): each valid prompt into `state`'s token history (a
    blink.engine.core.state.Slots), its request's fields into `inbox.requests` for
    blink.engine.core.admission, which `inbox.admit` then names; and mirrors each resident slot's cancel flag and
    window room."""
    g, S = table.geometry, state.num_slots
    _select[(1,)](table.memory, table.offsets, inbox.epoch, state.status, state.cancel, state.paused, state.room,
                  inbox.admit, inbox.arrival, inbox.arrivals, inbox.limit, inbox.fenced, inbox.grammar_ready, S,
                  RECORD=table.record_bytes,
                  HEADER_EPOCH=header_offset("epoch"), WINDOW=g.window, BLOCK_S=next_power_of_2(S),
                  INTERPRET=INTERPRET)
    start, span_bytes = span(slot_dtype(g))
    _admit[(S,)](table.memory, table.offsets, inbox.admit, state.tokens, state.tokens.stride(0), state.prompt_mask,
                 state.output_counts, inbox.requests, SPAN_START=start, SPAN=span_bytes, vocab=vocab, max_len=max_len,
                 MAX_PROMPT=g.max_prompt_tokens, RECORD=table.record_bytes,
                 BLOCK_SPAN=min(4096, next_power_of_2(span_bytes)),
                 BLOCK_P=min(1024, next_power_of_2(g.max_prompt_tokens)), BLOCK_V=min(1024, next_power_of_2(vocab)),
                 INTERPRET=INTERPRET)


def emit(table: DeviceTable, inbox: Inbox, state, out, page_bytes: int) -> None:
    """Writes each slot's scored prompt tokens, tokens and finish (`out`: a blink.engine.core.commit.StepOutput of
    a step with every sampler feature on; with drafts, each slot's run of them) into the table."""
    g, scored, runs, S = table.geometry, out.prompt, out.runs, state.num_slots
    if runs is None:
        token, count, logprob, top_ids, top_logprobs = out.token, out.token, out.logprob, out.top_ids, out.top_logprobs
    else:  # [S, K + 1, ...]: entry (s, i) at s * (K + 1) + i
        token, count, logprob = runs.token, runs.count, runs.logprob
        top_ids, top_logprobs = runs.top_ids.flatten(0, 1), runs.top_logprobs.flatten(0, 1)
    run = token.shape[1] if token.dim() > 1 else 1
    assert token.is_contiguous() and logprob.is_contiguous() and top_ids.stride() == top_logprobs.stride()
    top = min(g.top_logprobs, top_ids.shape[1])
    _emit[(S,)](table.memory, table.offsets, inbox.fenced, token, count, out.finish_reason, logprob, top_ids,
                top_logprobs, top_ids.stride(0), state.status, scored.first, scored.count, scored.token,
                scored.logprob, scored.top_ids, scored.top_logprobs, scored.top_ids.stride(0), state.preemptions,
                state.pages_out, state.pages_in, state.cached_tokens, state.wait_s, page_bytes,
                RECORD=table.record_bytes, WINDOW=g.window, TOP=g.top_logprobs, WIDTH=top,
                BLOCK_TOP=next_power_of_2(top), RUN=run, HEADER_STEPS=header_offset("steps"), INTERPRET=INTERPRET)


@triton.jit
def _demand(status, paused, seq_len, num_computed, demand, S, BLOCK_S: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    real = s < S
    resident = real & (tl.load(status + s, mask=real, other=ENGINE_FREE) != ENGINE_FREE)
    waiting = resident & ~tl.load(paused + s, mask=real, other=False)
    computed = tl.load(num_computed + s, mask=waiting, other=0)
    wants = tl.maximum(tl.load(seq_len + s, mask=waiting, other=0) - computed, 0)
    tl.store(demand, tl.sum(wants))
    tl.store(demand + 1, tl.sum(resident.to(tl.int64)))


def report_demand(state, demand: torch.Tensor) -> None:
    """[tokens the resident requests want next step, requests resident] into `demand` (host memory the driver
    reads when it likes; a kernel, not a copy, so it may sit inside a conditional graph node)."""
    _demand[(1,)](state.status, state.paused, state.seq_len, state.num_computed, demand, state.num_slots,
                  BLOCK_S=next_power_of_2(state.num_slots))


def next_power_of_2(n: int) -> int:
    return int(triton.next_power_of_2(max(1, n)))
