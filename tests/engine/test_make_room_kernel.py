"""The make-room kernels (blink.engine.kernels.make_room, in Triton's interpreter; the CPU's C++ twin,
blink.engine.kernels.cpu_make_room) decide as the torch reference (blink.engine.core.paging.make_room) does, field by
field (new pages, tokens, evicted, reserve, the keep and victim orders, the evicted's counts): random states with
prefix pages shared at the same columns (as hits map them), pools short by a little and by a lot, cancelled slots,
latency-sensitive and best-effort mixes with ties in priority and arrival, every policy, with and without prefix
caching and a mirror; find_pages with and without them leaves the same pages, tables and counts; a device step short
of pages with no mirror serves what the host mode serves; and the host mode with the C++ kernel bound serves what it
serves with the reference."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernels

import copy
import random

import pytest
import torch

from blink.engine.core import paging
from blink.engine.core.kv_cache import NULL_PAGE, FreeList
from blink.engine.core.policy import POLICIES, lexsort, policy_named
from blink.engine.core.prefix_cache import PrefixCache
from blink.engine.core.state import Slots, SlotStatus
from blink.engine.kernels import cpu_make_room
from blink.engine.kernels.make_room import make_room
from blink.engine.kernels.page_release import KERNELS
from blink.engine.kernels.page_sharing import AT_REST
from tests.support.cpu_kernels import cpu_kernels_or_skip

PAGE, WIDTH = 4, 8
STATE_FIELDS = ("num_computed", "pages_held", "block_table", "preemptions", "num_preemptions", "num_recomputes")


def _state(rng: random.Random, S: int, pages: int) -> tuple[Slots, torch.Tensor, list[int]]:
    """Slots mapping pages (a shared prefix among some, at the same columns), and the pages no slot maps."""
    state = Slots(S, WIDTH * PAGE, WIDTH, 16, torch.device("cpu"))
    free = list(range(1, pages))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(3)]
    for s in range(S):
        if rng.random() < 0.2:  # idle or rotated out: nothing held
            continue
        shared = prefix[:rng.choice([0, 0, 1, 2, 3])]
        pages = shared + [free.pop() for _ in range(rng.randrange(0 if shared else 1, WIDTH - 2 - len(shared)))]
        state.block_table[s, :len(pages)] = torch.tensor(pages, dtype=torch.int64)
        state.pages_held[s] = len(pages)
        state.num_computed[s] = len(pages) * PAGE - rng.choice([0, 0, 1, PAGE - 1])
        state.status[s] = SlotStatus.RUNNING
    ints = lambda *choices: torch.tensor([rng.choice(choices) for _ in range(S)])  # noqa: E731
    state.seq_len.copy_(state.num_computed + ints(1, 1, 2, 5, 9))
    state.prompt_len.copy_(torch.minimum(state.seq_len, ints(1, 4, 8)))
    state.arrival.copy_(ints(0, 1, 1, 2, 7))
    state.priority.copy_(ints(-3, 0, 0, 2))
    state.service_class.copy_(ints(0, 1, 1))
    state.cancel.copy_(torch.tensor([rng.random() < 0.15 for _ in range(S)]))
    resident = torch.tensor([bool(state.pages_held[s] > 0) or rng.random() < 0.5 for s in range(S)])
    return state, resident, free


class _Pool:
    """A page pool as find_pages sees it (kv_cache.PagePool's allocator part), without the K/V it stores."""

    page_size = PAGE

    def __init__(self, num_pages: int, free: FreeList | PrefixCache, prefix_cache: PrefixCache | None):
        self.num_pages, self.free, self.prefix_cache = num_pages, free, prefix_cache

    @property
    def num_free(self) -> torch.Tensor:
        return self.free.num_free

    def allocate(self, need: torch.Tensor, table: torch.Tensor, held: torch.Tensor, max_new: int) -> None:
        self.free.allocate(need, table, held, max_new)

    def release(self, which: torch.Tensor, table: torch.Tensor, held: torch.Tensor) -> None:
        self.free.release(which, table, held)


def _pool(free: list[int], state: Slots, pages: int, shared: bool, kernels: bool):
    """A pool whose free pages are `free`, its references those of the state's tables."""
    if not shared:
        pool = _Pool(pages, FreeList(pages, torch.device("cpu")), None)
        pool.free.stack[:len(free)] = torch.tensor(free)
        pool.free.num_free.fill_(len(free))
        return pool
    cache = PrefixCache(pages, PAGE, torch.device("cpu"))
    cache.kernels = KERNELS if kernels else None
    held = torch.arange(state.block_table.shape[1])[None, :] < state.pages_held[:, None]
    cache.refs.index_add_(0, state.block_table[held], torch.ones(int(held.sum()), dtype=torch.int64))
    cache.stack[:len(free)] = torch.tensor(free)
    cache.stack[len(free):] = 0
    cache.empties.fill_(len(free))
    cache.num_free.fill_(len(free))
    return _Pool(pages, cache, cache)


def _case(seed: int, S: int, shared: bool, kernels: bool = False):
    rng, pages = random.Random(seed), 6 * S + 8  # room for every slot's pages
    state, resident, free = _state(rng, S, pages)
    free = free[:rng.choice([0, 1, 3, len(free)])]  # short by a lot, a little, or not at all
    take = torch.where(resident & ~state.cancel, torch.tensor([rng.choice([0, 1, 1, 4, 9]) for _ in range(S)]), 0)
    precedence = torch.tensor(rng.sample(range(S), S))
    return state, _pool(free, state, pages, shared, kernels), resident, take, precedence, rng


def _cpp():
    """The CPU's twin, or a skip where its C++ does not build."""
    cpu_kernels_or_skip()
    return cpu_make_room.make_room


@pytest.fixture(params=["triton", "cpp"])
def kernel(request):
    """Each twin of paging.make_room: the device step's, and the CPU's where its C++ builds."""
    return make_room if request.param == "triton" else _cpp()


def _check(kernel, policy: str, shared: bool, mirror: bool, seeds: range, sizes: tuple[int, ...]) -> tuple[int, int]:
    """The kernel against the reference on these cases; returns how many slots were evicted and how many cut."""
    evictions = short = 0
    for seed in seeds:
        S = sizes[seed % len(sizes)]
        state, pool, resident, take, precedence, _ = _case(seed, S, shared)
        twin = copy.deepcopy(state)
        want = paging.make_room(state, pool, policy_named(policy), take, resident, precedence, mirror)
        got = kernel(twin, pool, policy_named(policy), take, resident, precedence, mirror)
        names = ("need", "take", "evicted", "reserve", "keep")
        for name, w, g in zip(names, want, got, strict=False):
            assert w.dtype == g.dtype and torch.equal(w, g), (seed, name, w, g)
        if got[5] is None:  # the C++'s, as the reference's: nobody gives any back
            assert want[5] is None, seed
        else:  # the Triton kernel's order whether or not anyone gives back
            victims = lexsort(policy_named(policy).victim_keys(state), first=resident & state.cancel)
            assert torch.equal(got[5], victims if want[5] is None else want[5]), seed
        for name in STATE_FIELDS:
            assert torch.equal(getattr(state, name), getattr(twin, name)), (seed, name)
        if shared:
            assert bool((pool.prefix_cache.extremes[0] == AT_REST["amin"]).all())
            assert bool((pool.prefix_cache.extremes[1] == AT_REST["amax"]).all())
        evictions += int(want[2].sum())
        short += int((want[1] < take).sum())
    return evictions, short


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shared", [True, False], ids=["prefix-cache", "no-sharing"])
@pytest.mark.parametrize("mirror", [False, True], ids=["no-mirror", "mirror"])
def test_the_kernel_makes_room_as_the_reference_does(kernel, policy, shared, mirror):
    evictions, short = _check(kernel, policy, shared, mirror, range(10), (8, 7))  # a power of two and not
    assert evictions > 0 and short > 0  # the cases made room, not only found it


@pytest.mark.parametrize("mirror", [False, True], ids=["no-mirror", "mirror"])
def test_the_kernel_makes_room_for_one_slot_and_for_many(kernel, mirror):
    evictions, short = _check(kernel, "slo", True, mirror, range(6), (1, 37))
    assert evictions > 0 and short > 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mirror", [False, True], ids=["no-mirror", "mirror"])
def test_the_cpp_kernel_makes_room_for_hundreds_of_slots(policy, mirror):
    for shared in (True, False):
        evictions, short = _check(_cpp(), policy, shared, mirror, range(4), (300, 257))
        assert evictions > 0 and short > 0


def test_the_cpp_kernel_refuses_state_it_cannot_read_by_name():
    state, pool, resident, take, precedence, _ = _case(3, 8, shared=True)
    args = (policy_named("slo"), take, resident, precedence, False)
    with pytest.raises(RuntimeError, match="take must be a contiguous"):
        _cpp()(state, pool, *args[:1], take.int(), *args[2:])
    with pytest.raises(RuntimeError, match="precedence must be a permutation"):
        _cpp()(state, pool, *args[:3], torch.zeros_like(precedence), False)
    state.block_table[int(state.pages_held.argmax()), 0] = pool.num_pages
    pool.num_free.fill_(0)  # short: the pages' holders are looked up
    with pytest.raises(RuntimeError, match="maps page"):
        _cpp()(state, pool, args[0], torch.full_like(take, PAGE), *args[2:])


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_find_pages_with_the_kernel_leaves_what_the_reference_leaves(kernel, policy):
    """The whole second half of the plan, pages given back and taken included, with the pool's own kernels (the
    device step's with its kernel; the host mode's torch with the C++)."""
    preempted = 0
    for seed in range(8):
        state, pool, resident, take, precedence, _ = _case(100 + seed, 8, shared=True, kernels=kernel is make_room)
        twin, twin_pool = copy.deepcopy(state), copy.deepcopy(pool)
        running = state.status == SlotStatus.RUNNING
        args = (policy_named(policy), None, 16)
        want = paging.find_pages(state, pool, *args, take, running, resident, precedence)
        got = paging.find_pages(twin, twin_pool, *args, take, running, resident, precedence, kernel)
        assert torch.equal(want[0], got[0]) and torch.equal(want[2], got[2]), seed
        for name in STATE_FIELDS:
            assert torch.equal(getattr(state, name), getattr(twin, name)), (seed, name)
        assert int(pool.num_free) == int(twin_pool.num_free)
        held = torch.arange(state.block_table.shape[1])[None, :] < state.pages_held[:, None]
        assert bool((state.block_table[held] != NULL_PAGE).all())
        preempted += int(state.num_preemptions)
    assert preempted > 0


def test_the_device_step_makes_room_without_a_mirror_as_the_host_does(checkpoint, small_table):
    """Requests sharing a prompt prefix in a pool far too small and no mirror: the device step (its make-room kernel
    evicting and counting the evicted) serves the tokens, finishes and preemptions the host mode serves."""
    import dataclasses

    from blink.engine.drive.device_step import DeviceStep
    from blink.engine.drive.host import HostDriver
    from blink.engine.engine import Engine, EngineConfig
    from blink.shared.slot_table import Request

    prefix = list(range(10, 26))  # two pages of 8
    requests = {slot: Request([*prefix, *range(30 + 9 * slot, 36 + 9 * slot)], 18, temperature=0.0, ignore_eos=True)
                for slot in range(4)}

    def serve(device: bool) -> dict:
        engine = Engine(EngineConfig(model=str(checkpoint("qwen3")), max_num_seqs=4, max_num_batched_tokens=32,
                                     num_pages=11, page_size=8, max_model_len=64, swap_space=0))
        assert engine.mirror is None and engine.pool.prefix_cache is not None
        if device:
            stepper = DeviceStep(engine, small_table)
            step = lambda: stepper.run(stepper.buckets[-1])  # noqa: E731 - the whole budget, as the host plans
        else:
            step = HostDriver(engine, small_table).step
        for slot, request in requests.items():
            small_table.publish(slot, request)
        got = {slot: ([], None, None) for slot in requests}
        try:
            for i in range(400):
                step()
                if i % 2:
                    for slot in requests:
                        out = small_table.read(slot)
                        tokens, finish, stats = got[slot]
                        got[slot] = (tokens + out.tokens, out.finish or finish, out.stats or stats)
                if all(finish for _, finish, _ in got.values()):
                    break
            else:
                raise AssertionError(f"not finished: {got}")
            assert int(engine.pool.num_free) == engine.pool.usable_pages
        finally:
            if device:
                stepper.close()
            for slot in requests:
                small_table.free(slot)
        return {slot: (tokens, finish, dataclasses.replace(stats, wait_ms=0)) for slot, (tokens, finish, stats)
                in got.items()}

    host = serve(device=False)
    assert sum(stats.preemptions for *_, stats in host.values()) > 0  # the pool ran short
    assert serve(device=True) == host


@pytest.mark.parametrize("swap_space", [0, 1], ids=["recompute", "rotation"])
def test_the_host_mode_with_the_cpp_kernel_serves_what_the_reference_serves(checkpoint, swap_space):
    """A pool far too small for requests of different lengths (some sharing a prompt prefix), greedy and seeded, one
    ended by a stop id and one by max_tokens: the host mode with the C++ make_room bound generates the reference's
    tokens, logprobs and finishes, and preempts, recomputes and rotates as often."""
    cpu_kernels_or_skip()
    from blink.engine import LLM, SamplingParams
    from blink.engine.core.bookkeeping import TORCH_BOOKKEEPING, Bookkeeping
    from blink.engine.core.scheduler import PlanKernels

    model = str(checkpoint("qwen3"))
    gen = torch.Generator().manual_seed(3)
    shared = list(range(3, 20))
    prompts = [shared + list(range(40, 40 + n)) if i % 2 else torch.randint(3, 1174, (n,), generator=gen).tolist()
               for i, n in enumerate((5, 40, 9, 23, 2, 30, 14, 51))]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    stop = LLM(model, max_num_seqs=1, max_num_batched_tokens=32, num_pages=40, page_size=8,
               max_model_len=104).generate([prompts[0]], greedy)[0].token_ids[6]
    seeded = dict(temperature=0.8, top_k=8, max_tokens=30, ignore_eos=True, logprobs=1)
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], logprobs=1),
              SamplingParams(**{**seeded, "max_tokens": 4}, seed=1), greedy,
              *(SamplingParams(**seeded, seed=i) if i % 2 else greedy for i in range(5))]
    calls = []

    def spy(*args):
        calls.append(args[3].shape[0])
        return cpu_make_room.make_room(*args)

    served = []
    for bookkeeping in (TORCH_BOOKKEEPING, Bookkeeping(plan=PlanKernels(make_room=spy))):
        llm = LLM(model, max_num_seqs=6, max_num_batched_tokens=32, num_pages=14, page_size=8, max_model_len=104,
                  swap_space=swap_space)
        llm.engine.step.use(bookkeeping)
        outputs = [(o.token_ids, o.logprobs, o.finish_reason) for o in llm.generate(prompts, params)]
        engine = llm.engine
        moved = engine.mirror.pages_moved.tolist() if engine.mirror else None
        served.append((outputs, int(engine.state.num_preemptions), int(engine.state.num_recomputes), moved))
        assert int(engine.pool.num_free) == engine.pool.usable_pages  # every page came back
    assert served[1] == served[0]
    outputs, preemptions, recomputes, moved = served[0]
    assert calls and preemptions > 0 and (moved[0] > 0 if swap_space else recomputes > 0)  # the pool ran short
    assert outputs[0][2] == "stop" and len(outputs[0][0]) == 7 and len(outputs[1][0]) == 4
