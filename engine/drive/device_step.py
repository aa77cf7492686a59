"""The whole engine step as device work, for the device drive modes: admit → plan → forward → sample → commit →
publish, with no host sync and no host work per request.

`DeviceStep.run(bucket)` enqueues one step whose shapes depend on the token bucket alone, so it can be captured
once per bucket and replayed (the `graph` mode) or looped on the device (`persistent`). The host's only inputs are
a clock and an admission limit it may write into pinned memory at any time; its only output is the demand the
device publishes there (tokens the resident requests want next, and how many are resident), which the driver reads
when it likes, to pick the next bucket.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from blink.engine.core.admission import admit, field_views
from blink.engine.core.bookkeeping import Bookkeeping
from blink.engine.core.policy import StepCostModel
from blink.engine.core.sampler import SamplerFeatures
from blink.engine.core.scheduler import PlanKernels, max_chunk_rows, plan
from blink.engine.core.speculation import Speculation
from blink.engine.core.step import StepShape
from blink.engine.drive.device_grammars import READY, DeviceGrammars
from blink.engine.drive.table_memory import TableMemory, device_alias
from blink.engine.engine import Engine
from blink.engine.kernels import admission, page_release, step_cost
from blink.engine.kernels import commit as commit_kernel
from blink.engine.kernels import draft as draft_kernels
from blink.engine.kernels.exchange import DeviceTable, Inbox, emit, report_demand, take_requests
from blink.engine.kernels.hand_out import hand_out, head
from blink.engine.kernels.lay_out import lay_out
from blink.engine.kernels.make_room import make_room
from blink.engine.kernels.plan_tail import settle_take
from blink.engine.kernels.prefix_cache import reuse_prefix
from blink.engine.kernels.rotation import copy_pages
from blink.shared.slot_table import SlotState, SlotTable, slot_dtype, window_room

# The bookkeeping's parts that run as kernels in the device step (unless the bookkeeping is compiled): the plan's, the
# commit's per-slot part, and with drafts their proposal and the settle of runs.
DEVICE_BOOKKEEPING = Bookkeeping(PlanKernels(head=head, reuse_prefix=reuse_prefix, hand_out=hand_out,
                                             make_room=make_room, settle_take=settle_take, lay_out=lay_out),
                                 settle=commit_kernel.settle, advance=commit_kernel.advance,
                                 settle_runs=commit_kernel.settle_runs,
                                 draft=draft_kernels.draft)

# Every sampling feature is on: a captured step cannot branch on the requests it will meet (neutral parameters
# leave tokens unchanged). The fused sampler branches per row on the device, so a row still pays only for its own.
ALL_FEATURES = SamplerFeatures(**dict.fromkeys(SamplerFeatures.__dataclass_fields__, True))

# Prompt logprobs a captured step scores at most (a request that asks for them is prefilled this many tokens a
# step): rows of logits every captured step computes beside its sampling rows, in the same output-embedding pass.
PROMPT_ROWS = 16

# What the device modes do not do yet (the host mode does), said at start-up and in /ready.
LIMITATIONS: tuple[str, ...] = ()
# A gap between two steps longer than this many times the fit's prediction is a nap, not a step: left out of it.
NAP_OVER_PREDICTION = 4.0


class DeviceStep:
    def __init__(self, engine: Engine, table: SlotTable):
        engine.check_geometry(table.geometry)
        if engine.model_config.moe is not None and not engine.model.kernels.moe_captures:
            raise RuntimeError("a mixture of experts runs in the device step with the Triton kernels only (the torch "
                               "path reads on the host which experts run): unset BLINK_KERNELS")
        self.engine, self.state, self.step = engine, engine.state, engine.step
        device = engine.device
        pinned = device.type == "cuda"
        self.memory = TableMemory(table, device)
        self.table = DeviceTable.over(self.memory.tensor, table.geometry)
        # The host's side, in page-locked memory the kernels read and write in place (no copy nodes in the graph):
        self.clock = torch.zeros(1, dtype=torch.float64, pin_memory=pinned)  # the host writes time.monotonic()
        self.limit = torch.full((1,), self.state.num_slots, dtype=torch.int64, pin_memory=pinned)  # admission limit
        self.demand = torch.zeros(2, dtype=torch.int64, pin_memory=pinned)  # [tokens wanted, resident], the device's
        self.inbox = Inbox.create(self.table, int(table.header["epoch"]), device_alias(self.clock, device),
                                  device_alias(self.limit, device))
        # Structured outputs: the grammar walk (its gate admits a constrained record once its table is in place).
        self.grammars = DeviceGrammars(engine, table, engine.config.grammar_arena_bytes)
        self.inbox.grammar_ready = self.grammars.device_ready
        self.step.grammar = self.grammars  # Step.run masks the rows through it
        self._record = slot_dtype(table.geometry)
        self._demand = device_alias(self.demand, device)
        self.buckets = self.step.token_buckets
        self.page_bytes = engine.pool.page_bytes  # in the pages' dtype (FP8 pages: half)
        # KV rotation (--swap-space): the plan lays out page moves on the device and the step copies them between
        # the pool and the mirror's pinned memory, which the device addresses directly.
        self.mirror = engine.mirror
        if self.mirror is not None:  # each cache's, the pool's and a draft model's: [pages, K/V, layers, page, ...]
            self._mirror_kv = [(data[:, 0].transpose(0, 1), data[:, 1].transpose(0, 1))
                               for data in (device_alias(data, device) for data in self.mirror.data)]
        self._in_stream = torch.cuda.Stream(device) if self.mirror is not None and pinned else None
        self._last_now = torch.zeros(1, dtype=torch.float64, device=device)
        self._last_tokens = torch.zeros((), dtype=torch.int64, device=device)  # what the previous step computed
        self.cost_model = StepCostModel(self.step.cost)  # fed from the clock the steps read: the TPOT cap's fit
        if self.step.planner is plan:  # unless compiled (the references, whole)
            self.step.use(DEVICE_BOOKKEEPING)

    @property
    def fenced(self) -> bool:
        """Host side, syncs: whether the device saw a newer engine's epoch and stopped writing."""
        return bool(self.inbox.fenced.item())

    def run(self, bucket: int) -> None:
        """Enqueues one step that computes at most `bucket` tokens."""
        state, engine, inbox = self.state, self.engine, self.inbox
        self._time_previous_step()
        self.take()
        if engine.pool.prefix_cache is not None:
            engine.pool.prefix_cache.kernels = None if self.step.planner is not plan else page_release.KERNELS
        planned = self.step.planner(state, engine.pool, bucket, self.step.policy, self.mirror, self.step.cost,
                                    self.prompt_rows(bucket), self.step.plan_kernels, speculation=self._speculation())
        sizes = planned.sizes
        self._last_tokens.copy_(sizes.tokens)
        if self.mirror is not None:
            moves = planned.moves
            self._rotate(moves.out_src, moves.out_dst, sizes.pages_out, to_mirror=True)  # this forward may reuse them
            with self._beside_the_forward():  # those coming back take no tokens before the next step
                self._rotate(moves.in_src, moves.in_dst, sizes.pages_in, to_mirror=False)
        out = self.step.run(planned, self.shape(bucket), ALL_FEATURES, self.mirror)
        if self._in_stream is not None:  # the next step's moves may reuse the mirror pages this one read
            torch.cuda.current_stream(self.engine.device).wait_stream(self._in_stream)
        self.grammars.advance(out.token, out.finish_reason)  # before emit: a finished slot's state is gone first
        emit(self.table, inbox, state, out, self.page_bytes)
        report_demand(state, self._demand)

    def _speculation(self) -> Speculation | None:
        """The step's speculation as this step plans with it: a draft model's forwards run at the shape's rows
        whether any slot drafts or not, a cost the drafting threshold must not weigh here (the host mode runs them
        for the drafting slots only)."""
        speculation = self.step.speculation
        return speculation and dataclasses.replace(speculation, draft_ratio=0.0)

    def _time_previous_step(self) -> None:
        """Seconds since the previous step, by the clock the step reads: what that step took (the step-cost fit
        learns from it unless it computed nothing or a nap came after it), and what each resident request that was
        not scheduled waited."""
        step_cost.observe_since(self.cost_model, self.inbox.now, self._last_now, self._last_tokens,
                                NAP_OVER_PREDICTION)  # StepCostModel.observe_since in one kernel

    @contextlib.contextmanager
    def _beside_the_forward(self):
        """On CUDA, work on a stream of its own that runs beside the rest of the step (SuperInfer's duplex KV:
        pages come in while the forward computes), ordered after what was enqueued before it; `run` joins it
        before the step ends. Captured, the two streams are two branches of the step's graph."""
        if self._in_stream is None:
            yield
            return
        self._in_stream.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(self._in_stream):
            yield

    def _rotate(self, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor, to_mirror: bool) -> None:
        for cache, mirrored in zip(self.mirror.caches, self._mirror_kv, strict=True):
            for pool_half, mirror_half in zip(cache, mirrored, strict=True):
                copy_pages(*((pool_half, mirror_half) if to_mirror else (mirror_half, pool_half)), src, dst, count)

    def take(self) -> None:
        """Admission: what the ingress published into the state, through the one admission (blink.engine.core.admission)
        with the request fields the exchange kernel copied out of the table."""
        engine, inbox = self.engine, self.inbox
        take_requests(self.table, inbox, self.state, engine.model_config.vocab_size, engine.max_model_len)
        if self.step.admitter is admit:  # the torch reference's landing in one kernel, unless it was compiled
            admission.admit(self.state, inbox.admit, inbox.requests, self._record, inbox.now, inbox.arrival,
                            engine.max_model_len)
        else:
            self.step.admitter(self.state, inbox.admit, field_views(inbox.requests, self._record), inbox.now,
                               inbox.arrival, engine.max_model_len)
        self.grammars.land(inbox.admit)  # each admitted slot's first state, or none
        if self.step.speculation is not None:  # the grammar masks one row per slot: a constrained slot never drafts
            state = self.state
            state.draft_off.copy_(torch.where(inbox.admit, self.grammars.state >= 0, state.draft_off))

    def shape(self, bucket: int) -> StepShape:
        S, speculation = self.state.num_slots, self.step.speculation
        rows = min(S, bucket) if speculation is None else speculation.rows(S, bucket)  # with drafts: 1 + K a slot
        decode_rows = rows if speculation is not None and speculation.decode_runs else min(S, bucket)
        # A draft model's forwards: a row for each slot that can draft in the bucket (two tokens at least), K after
        # the first.
        drafts = self.step.drafter is not None
        return StepShape(tokens=bucket, context=self.step.context_buckets[-1], decode_rows=decode_rows,
                         chunk_rows=max_chunk_rows(bucket, S), rows=rows, prompt_rows=self.prompt_rows(bucket),
                         draft_rows=min(S, bucket // 2) if drafts else 0, draft_steps=speculation.k if drafts else 0)

    @staticmethod
    def prompt_rows(bucket: int) -> int:
        return min(bucket, PROMPT_ROWS)

    def bucket_for(self, demand: int) -> int:
        return next((b for b in self.buckets if b >= demand), self.buckets[-1])

    def close(self) -> None:
        self.grammars.close()
        self.table = None
        self.memory.close()


def wants_a_step(state, room, cancel, admissible=True):
    """Whether a slot of this engine's epoch gives the device step work (numpy arrays or numbers): a request published
    (and `admissible` under the admission limit), or an admitted one whose reader made room in its window (`room`:
    window_room) or which was cancelled: the step refreshes `paused` and ends cancellations. The persistent loop's
    pick kernel has a C copy of it, tested against this one (tests/engine/test_window_rule.py)."""
    return (((state == SlotState.SUBMITTED) & admissible)
            | ((state == SlotState.ADMITTED) & ((room > 0) | (cancel != 0))))


# window_room and wants_a_step in CUDA C, for the persistent loop's pick kernel (which is not held to the limit:
# admission is). tests/engine/test_window_rule.py compiles them for the host and runs them against the Python ones.
WANTS_A_STEP_C = r"""
static __host__ __device__ __forceinline__ long long window_room(unsigned int produced, unsigned int consumed,
                                                                  long long window) {
    return window - (long long)(produced - consumed);  // unsigned: the difference wraps as the counters do
}

// The window's counters and the cancel flag are read only for an admitted slot: each read crosses the bus.
static __host__ __device__ __forceinline__ int wants_a_step(unsigned int state, const unsigned char* record,
                                                            long long produced_at, long long consumed_at,
                                                            long long cancel_at, long long window) {
    return state == SUBMITTED
           || (state == ADMITTED
               && (window_room(*(const volatile unsigned int*)(record + produced_at),
                               *(const volatile unsigned int*)(record + consumed_at), window) > 0
                   || *(const volatile unsigned int*)(record + cancel_at) != 0));
}
"""
WANTS_A_STEP_DEFINES = (f"-DSUBMITTED={int(SlotState.SUBMITTED)}u", f"-DADMITTED={int(SlotState.ADMITTED)}u")


class DeviceDriver:
    """What the `graph` and `persistent` drivers share (blink.engine.drive.driver.Driver): the device step, and the
    host-memory words through which the host sets the admission limit and reads what is resident."""

    limitations = LIMITATIONS
    failure: BaseException | None = None
    step: DeviceStep
    table: SlotTable

    @property
    def mirror(self):
        return self.step.mirror

    @property
    def resident(self) -> int:
        return int(self.step.demand[1])

    def progress(self) -> int:
        """The steps the device counted in the table (its steps are short: no count within one)."""
        return int(self.table.header["steps"])

    def idle(self) -> bool:
        """Nothing to step for (a read of host memory): the device wants no tokens, and no slot of this epoch
        `wants_a_step` (a constrained one once the grammar gate readied it). The persistent loop's `pick` makes the
        same check on the device (persistent.DUE_C)."""
        wanted, resident = self.step.demand.tolist()
        if wanted:
            return False
        slots, epoch = self.table.slots, int(self.table.header["epoch"])
        ours = slots["epoch"] == np.uint32(epoch)  # an older epoch's slots are the ingress's to reclaim
        room = window_room(slots["produced"].astype(np.int64), slots["consumed"].astype(np.int64),
                           self.table.geometry.window)
        # A record whose grammar's table is not in the arena yet waits for the gate, not for a step.
        gated = (slots["grammar_kind"] != 0) & (self.step.grammars.ready.numpy() != READY)
        due = wants_a_step(slots["state"], room, slots["cancel"],
                           admissible=(resident < int(self.step.limit[0])) & ~gated)
        return not np.any(ours & due)

    def set_admission_limit(self, limit: int | None) -> None:
        self.step.limit[0] = self.step.state.num_slots if limit is None else limit  # read by the next step
