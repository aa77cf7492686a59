"""The output window's one rule (blink.shared.slot_table.window_room) and the device drivers' "a slot wants a step"
(blink.engine.drive.device_step.wants_a_step), against their copies that cannot call Python: the exchange kernel's
Triton (in the interpreter, through the admission that mirrors each slot's room) and the persistent loop's CUDA C
(compiled for the host by its C++ compiler, on the same records), whose `due` holds a record at the admission limit
and at the grammar gate as DeviceDriver.idle does."""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from blink.engine.core.state import Slots, SlotStatus
from blink.engine.drive import persistent
from blink.engine.drive.device_grammars import READY, TAKEN
from blink.engine.drive.device_step import WANTS_A_STEP_C, DeviceDriver, wants_a_step
from blink.engine.kernels.exchange import DeviceTable, Inbox, take_requests
from blink.shared.slot_table import Geometry, SlotState, SlotTable, window_room

WINDOW = 5
WRAP = 2**32
# (produced, consumed): empty, part full, full, and the same across the counters' wrap at 2**32.
COUNTERS = [(0, 0), (3, 1), (5, 0), (9, 4), (WRAP - 1, WRAP - 3), (1, WRAP - 2), (2, WRAP - 3), (WRAP - 1, WRAP - 1)]


def test_the_rule():
    rooms = [5, 3, 0, 0, 3, 2, 0, 5]
    assert [window_room(p, c, WINDOW) for p, c in COUNTERS] == rooms
    produced, consumed = (np.array(x, dtype=np.uint32).astype(np.int64) for x in zip(*COUNTERS, strict=True))
    assert window_room(produced, consumed, WINDOW).tolist() == rooms  # on arrays
    assert window_room(torch.from_numpy(produced), torch.from_numpy(consumed), WINDOW).tolist() == rooms


@pytest.fixture
def table():
    table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(len(COUNTERS), 16, WINDOW, page_size=8))
    yield table
    table.unlink()


def test_the_exchange_kernel_mirrors_each_slots_room_by_the_rule(table):
    """Each resident slot's room and pause, as admission's select kernel mirrors them into the state."""
    S = len(COUNTERS)
    state = Slots(S, 32, 4, 16, torch.device("cpu"))
    state.status.fill_(SlotStatus.RUNNING)  # resident: their windows are mirrored
    records = table.slots
    records["state"], records["epoch"] = SlotState.ADMITTED, table.header["epoch"]
    records["produced"], records["consumed"] = zip(*COUNTERS, strict=True)
    device = DeviceTable.over(torch.from_numpy(np.frombuffer(table.mapping, dtype=np.uint8)), table.geometry)
    one = torch.zeros(1, dtype=torch.float64)
    inbox = Inbox.create(device, int(table.header["epoch"]), one, torch.full((1,), S))
    take_requests(device, inbox, state, vocab=16, max_len=32)
    room = window_room(records["produced"].astype(np.int64), records["consumed"].astype(np.int64), WINDOW)
    assert state.room.tolist() == room.tolist()
    assert state.paused.tolist() == (room <= 0).tolist()


@pytest.fixture(scope="module")
def rules_in_c(tmp_path_factory):
    """The rules' C copy compiled for the host, each behind a C entry point."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    source = tmp_path_factory.mktemp("rules") / "rules.cpp"
    source.write_text("#define __host__\n#define __device__\n#define __forceinline__ inline\n" + WANTS_A_STEP_C
                      + persistent.DUE_C + """
extern "C" long long room(unsigned int produced, unsigned int consumed, long long window) {
    return window_room(produced, consumed, window);
}
extern "C" int wants(unsigned int state, const unsigned char* record, long long produced_at, long long consumed_at,
                     long long cancel_at, long long window) {
    return wants_a_step(state, record, produced_at, consumed_at, cancel_at, window);
}
extern "C" int due_(unsigned int state, const unsigned char* record, long long produced_at, long long consumed_at,
                    long long cancel_at, long long window, long long grammar_kind_at, int grammar_ready,
                    int under_limit) {
    return due(state, record, produced_at, consumed_at, cancel_at, window, grammar_kind_at, grammar_ready,
               under_limit);
}
""")
    library = source.with_suffix(".so")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", *persistent.PICK_DEFINES, str(source), "-o", str(library)],
                   check=True)
    rules = ctypes.CDLL(str(library))
    rules.room.restype = ctypes.c_longlong
    rules.room.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_longlong]
    rules.wants.argtypes = [ctypes.c_uint, ctypes.c_void_p, *[ctypes.c_longlong] * 4]
    rules.due_.argtypes = [ctypes.c_uint, ctypes.c_void_p, *[ctypes.c_longlong] * 5, ctypes.c_int, ctypes.c_int]
    return rules


def test_the_persistent_loops_c_room_is_the_rule(rules_in_c):
    for produced, consumed in COUNTERS:
        for window in (1, WINDOW, 64):
            assert rules_in_c.room(produced, consumed, window) == window_room(produced, consumed, window)


@pytest.mark.parametrize(("state", "cancel"), itertools.product(list(SlotState), (0, 1)))
def test_the_c_copy_of_wants_a_step(rules_in_c, table, state, cancel):
    """On the table's own records: each slot state, each window's fill, cancelled or not."""
    records, fields = table.slots, table.slots.dtype.fields
    records["produced"], records["consumed"] = zip(*COUNTERS, strict=True)
    records["cancel"] = cancel
    base = records.ctypes.data
    for slot in range(len(COUNTERS)):
        record = records[slot]
        room = window_room(int(record["produced"]), int(record["consumed"]), WINDOW)
        got = rules_in_c.wants(int(state), ctypes.c_void_p(base + slot * records.dtype.itemsize),
                               fields["produced"][1], fields["consumed"][1], fields["cancel"][1], WINDOW)
        assert bool(got) == bool(wants_a_step(int(state), room, cancel)), (state, slot)


@pytest.mark.parametrize(("resident", "limit"), [(0, 8), (2, 2)])
def test_the_loop_idles_as_the_graph_mode_does(rules_in_c, table, resident, limit):
    """The pick kernel's `due` on every slot against DeviceDriver.idle on the same table: records submitted with and
    without a grammar, the gate's word not set, ready or already taken, under the admission limit and at it, beside
    admitted ones whose windows are full. An idle loop with a record at the gate or the limit naps, not steps."""
    records, fields = table.slots, table.slots.dtype.fields
    epoch, S = table.header["epoch"], len(COUNTERS)
    ready = np.zeros(S, dtype=np.int32)
    driver = SimpleNamespace(table=table, step=SimpleNamespace(
        demand=torch.tensor([0, resident]), limit=torch.tensor([limit]),
        grammars=SimpleNamespace(ready=torch.from_numpy(ready))))
    full = (5, 0)  # an admitted slot waiting for its reader: no step for it
    cases = list(itertools.product((0, 1), (0, READY, TAKEN)))  # (grammar kind, the gate's word) of a submitted one
    for kind, word in cases:
        records["state"], records["epoch"], records["cancel"] = SlotState.ADMITTED, epoch, 0
        records["produced"], records["consumed"] = full
        records["grammar_kind"], ready[:] = 0, 0
        records[0]["state"], records[0]["grammar_kind"], ready[0] = SlotState.SUBMITTED, kind, word
        base = records.ctypes.data
        dues = [rules_in_c.due_(int(records[s]["state"]), ctypes.c_void_p(base + s * records.dtype.itemsize),
                                fields["produced"][1], fields["consumed"][1], fields["cancel"][1], WINDOW,
                                fields["grammar_kind"][1], int(ready[s]), int(resident < limit)) for s in range(S)]
        assert (not any(dues)) == DeviceDriver.idle(driver), (kind, word)
        gated = kind != 0 and word != READY
        assert bool(dues[0]) == (resident < limit and not gated), (kind, word)
        assert not any(dues[1:])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (the GPU tests compile it with NVRTC)")
def test_the_pick_kernel_compiles(tmp_path):
    source = tmp_path / "pick.cu"
    source.write_text(persistent._PICK)
    cubin = tmp_path / "pick.cubin"
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", *persistent.PICK_DEFINES, str(source), "-o", str(cubin)],
                   check=True)
