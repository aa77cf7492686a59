"""The CPU kernels' own threads (engine/kernels/pool.cpp): sections split as at::parallel_for splits them, every index
once, errors raised in the caller, several callers at once, a forked child."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading

import pytest
import torch

from blink.engine.kernels import cpu

pytestmark = pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("c++")),
                                reason="the CPU kernels are built with a C++ compiler, and none is on PATH")
NO_FAILURE = -(1 << 62)


@pytest.fixture(scope="module")
def ops():
    return cpu.ops()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def expected_chunks(begin: int, end: int, grain: int, threads: int) -> torch.Tensor:
    """at::parallel_for's split: min(threads, ceil(range / grain)) chunks of ceil(range / chunks), inline for one."""
    tasks = min(threads, -(-(end - begin) // max(grain, 1)))
    index = torch.arange(begin, end)
    if tasks <= 1:
        return torch.full_like(index, begin)
    chunk = -(-(end - begin) // tasks)
    return begin + (index - begin) // chunk * chunk


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("begin, end, grain", [(0, 1, 1), (0, 2, 1), (0, 3, 1), (5, 100, 1), (0, 48, 16),
                                               (0, 16, 16), (0, 17, 16), (3, 3, 1), (0, 10000, 4096)])
def test_sections_split_as_torch_splits_them_and_cover_each_index_once(ops, threads, count, begin, end, grain):
    threads(count)
    for _ in range(50):  # again and again: a worker that missed or repeated a section shows
        torch.testing.assert_close(ops.pool_chunks(begin, end, grain, NO_FAILURE),
                                   expected_chunks(begin, end, grain, count))


@pytest.mark.parametrize("fail_at", [0, 99])  # the caller's chunk, a worker's
def test_an_error_in_any_chunk_is_raised_to_the_caller_and_the_threads_go_on(ops, threads, fail_at):
    threads(2)
    with pytest.raises(RuntimeError, match=f"index {fail_at} fails"):
        ops.pool_chunks(0, 100, 1, fail_at)
    torch.testing.assert_close(ops.pool_chunks(0, 100, 1, NO_FAILURE), expected_chunks(0, 100, 1, 2))


def test_sections_from_several_threads_at_once_each_run_whole(ops, threads):
    threads(2)
    want = expected_chunks(0, 1000, 1, 2)
    failures: list[str] = []

    def call() -> None:
        for _ in range(200):
            got = ops.pool_chunks(0, 1000, 1, NO_FAILURE)
            if (got < 0).any():  # -1: an index run twice, -2: never; the chunks themselves may be torch's
                failures.append(str(got))

    callers = [threading.Thread(target=call) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert not failures
    torch.testing.assert_close(ops.pool_chunks(0, 1000, 1, NO_FAILURE), want)


def _child(queue) -> None:
    queue.put(cpu.ops().pool_chunks(0, 64, 1, NO_FAILURE).tolist())


def test_a_forked_child_runs_sections_on_threads_of_its_own(ops, threads):
    threads(2)
    ops.pool_chunks(0, 64, 1, NO_FAILURE)  # the parent's threads exist; the child has none of them
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "the child hung or failed in a section"
    assert queue.get(timeout=5) == expected_chunks(0, 64, 1, 2).tolist()
