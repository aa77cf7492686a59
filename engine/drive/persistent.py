"""The `persistent` drive mode: the device step loops on the device, launched once, with no host work per token.

One CUDA graph holds the loop: a WHILE conditional node whose body is a small `pick` kernel (NVRTC-compiled) and,
after it, a SWITCH conditional node with one branch per token bucket, each branch a child graph made from the
bucket's captured step (before CUDA 12.8, which brought SWITCH nodes, a chain of IF nodes, one per bucket).

`pick` ends the loop when the host sets a stop flag in pinned memory; the check comes between steps, so a stop
never cuts one in half and `start()` carries on with every admitted request. While nothing is resident and the
table holds nothing admissible (a submitted record past the admission limit, or whose grammar the gate has not
readied, is not: the rule of `DeviceDriver.idle`), or while every resident request waits for its reader (its output
window full; `pick` reads the window counters and cancel flags itself), it naps (`nanosleep`, 64 ns doubling up
to 16 µs) rather than step on padding, so a new request or a reader's room waits at most a nap and a poll for the
loop. Otherwise it picks the smallest bucket that holds the demand the last step published, and advances the step's
clock (host memory the step reads in place) from the GPU's global timer: the host no longer writes it.

Needs CUDA 12.4+ (driver and runtime), cuda-python (the `cuda` extra), NVRTC and compute capability 7.0+;
`unavailable_reason()` says which is missing, and the engine then falls back to the `graph` mode.
"""

from __future__ import annotations

import functools
import importlib.metadata
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import structlog
import torch

from blink.engine.drive.device_grammars import READY
from blink.engine.drive.device_step import WANTS_A_STEP_C, WANTS_A_STEP_DEFINES, DeviceDriver, DeviceStep
from blink.shared.slot_table import HEADER_BYTES, SlotTable, slot_dtype

log = structlog.get_logger()

MIN_CUDA = 12040  # conditional IF and WHILE nodes (and cuda-python without the phGraph_out bug of 12.3)
SWITCH_CUDA = 12080  # conditional SWITCH nodes
NAP_NS = (64, 16_000)  # idle back-off, first and longest nap
PICK_DEFINES = (*WANTS_A_STEP_DEFINES, f"-DNAP_MIN_NS={NAP_NS[0]}u", f"-DNAP_MAX_NS={NAP_NS[1]}u",
                f"-DGRAMMAR_READY={READY}")

# The loop's own part of DeviceDriver.idle's rule, in C (tests/engine/test_window_rule.py runs it on the host against
# `idle` on the same table): a submitted record is admissible only under the admission limit and, with a grammar,
# once the grammar gate readied its block (engine/drive/device_grammars.py), so a record waiting at either does not
# make the loop step.
DUE_C = r"""
static __host__ __device__ __forceinline__ int due(unsigned int state, const unsigned char* record,
                                                   long long produced_at, long long consumed_at, long long cancel_at,
                                                   long long window, long long grammar_kind_at, int grammar_ready,
                                                   int under_limit) {
    if (state == SUBMITTED
        && (!under_limit
            || (*(const volatile unsigned int*)(record + grammar_kind_at) != 0 && grammar_ready != GRAMMAR_READY)))
        return 0;
    return wants_a_step(state, record, produced_at, consumed_at, cancel_at, window);
}
"""

# Every argument is 8 bytes wide, so the host packs them as one uint64 array. handles[0] is the WHILE node's;
# then either the SWITCH node's (if_chain == 0) or one per bucket's IF node. cudaGraphSetConditional is a
# device-runtime builtin the compiler lowers itself: declared here, NVRTC needs no include path and nothing is
# linked (the declaration is that of cuda_device_runtime_api.h).
_PICK = WANTS_A_STEP_C + DUE_C + r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);

static __device__ __forceinline__ void nap(unsigned int ns) { asm volatile("nanosleep.u32 %0;" :: "r"(ns)); }

static __device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __device__ void choose(const unsigned long long* handles, long long if_chain, long long n, long long branch) {
    if (if_chain) {
        for (long long i = 0; i < n; ++i) cudaGraphSetConditional(handles[1 + i], i == branch);
    } else {
        cudaGraphSetConditional(handles[1], (unsigned int)branch);  // branch == n: no branch runs
    }
}

// Bounded for the most threads it is launched with (1024), so NVRTC never leaves it too many registers to launch.
extern "C" __global__ void __launch_bounds__(1024) pick(
        const unsigned long long* handles, long long if_chain, const long long* buckets, long long n,
        const volatile int* stop, const long long* demand, const int* fenced, const long long* epoch,
        const unsigned char* records, long long num_slots, long long record_bytes, long long state_at,
        long long epoch_at, long long produced_at, long long consumed_at, long long cancel_at, long long window,
        volatile double* clock, double* origin_s, unsigned long long* origin_ns, const volatile long long* limit,
        const volatile int* grammar_ready, long long grammar_kind_at) {
    const long long want = demand[0];  // tokens the resident requests want, as the last step published
    const bool fenced_now = *fenced != 0;  // a newer engine owns the table: idle until told to stop
    unsigned int ns = NAP_MIN_NS;
    for (;;) {
        if (__syncthreads_or(threadIdx.x == 0 && *stop != 0)) {
            if (threadIdx.x == 0) {
                cudaGraphSetConditional(handles[0], 0);
                choose(handles, if_chain, n, n);
            }
            return;
        }
        // A step is due for tokens wanted or a slot that is `due`. Nothing wanted while requests are resident
        // means each waits for its reader (window full), so the loop reads the window counters here and naps
        // until one moves, instead of stepping on padding; a submitted record past the admission limit, or whose
        // grammar's table is not in the arena yet, waits the same way.
        int work = want > 0;
        if (!work) {  // uniform: every thread read the same demand
            const int under_limit = demand[1] < *limit;  // read each time round: the host may raise it during a nap
            for (long long s = threadIdx.x; s < num_slots; s += blockDim.x) {
                const unsigned char* record = records + s * record_bytes;
                const unsigned int state = *(const volatile unsigned int*)(record + state_at);
                if (*(const volatile unsigned int*)(record + epoch_at) != (unsigned long long)*epoch) continue;
                work |= due(state, record, produced_at, consumed_at, cancel_at, window, grammar_kind_at,
                            grammar_ready[s], under_limit);
            }
            work = __syncthreads_or(work);
        }
        if (work && !fenced_now) break;
        if (threadIdx.x == 0) nap(ns);
        ns = ns < NAP_MAX_NS / 2 ? ns * 2 : NAP_MAX_NS;
    }
    if (threadIdx.x != 0) return;
    const unsigned long long now = global_ns();
    if (*origin_ns == 0) {  // the first pick since start(): the host wrote its clock just before the launch
        *origin_ns = now;
        *origin_s = *clock;
    }
    *clock = *origin_s + (double)(now - *origin_ns) * 1e-9;  // the step reads it in place
    __threadfence_system();
    long long branch = 0;
    while (branch < n - 1 && buckets[branch] < want) ++branch;
    choose(handles, if_chain, n, branch);
}
"""


class PersistentUnavailable(RuntimeError):
    """This machine cannot run the persistent loop; the message says why. The engine falls back to `graph`."""


@dataclass(frozen=True)
class _Cuda:
    driver: ModuleType
    runtime: ModuleType
    nvrtc: ModuleType
    version: tuple[int, int]  # of the bindings


@dataclass(frozen=True)
class _Support:
    cuda: _Cuda
    switch: bool  # SWITCH nodes; else a chain of IF nodes
    cubin: bytes  # the pick kernel, for this GPU


def unavailable_reason() -> str | None:
    """None when this machine can run the persistent loop, else why not (no CUDA, no cuda-python, versions,
    NVRTC). Needs no model: for `blink doctor` and the engine's choice of drive mode."""
    try:
        _support(None)
    except PersistentUnavailable as e:
        return str(e)
    except Exception as e:  # a failing check is a reason too: the engine must still start, in another mode
        return f"checking for the persistent loop failed: {e}"
    return None


def _support(index: int | None) -> _Support:
    if not torch.cuda.is_available():
        raise PersistentUnavailable("needs a CUDA GPU; torch sees none")
    cuda = _bindings()
    if cuda.version < (12, 4):
        raise PersistentUnavailable(f"cuda-python {_dotted(cuda.version)} predates conditional graph nodes: "
                                    "pip install 'cuda-python>=12.4'")
    try:
        driver = _ok(cuda.runtime.cudaDriverGetVersion(), "cudaDriverGetVersion")
        runtime = _ok(cuda.runtime.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
    except Exception as e:
        raise PersistentUnavailable(f"cannot read the CUDA versions: {e}") from e
    if driver == 0:
        raise PersistentUnavailable("no NVIDIA driver is installed")
    if min(driver, runtime) < MIN_CUDA:
        raise PersistentUnavailable(f"conditional graph nodes need CUDA 12.4+; the driver supports CUDA "
                                    f"{_dotted(driver)}, the runtime is {_dotted(runtime)}")
    if cuda.version[0] > driver // 1000:  # its NVRTC's cubins and its driver calls need a driver of its major
        raise PersistentUnavailable(f"cuda-python {_dotted(cuda.version)} needs a CUDA {cuda.version[0]} driver; "
                                    f"this one supports {_dotted(driver)}: pip install 'cuda-python<{cuda.version[0]}'")
    index = torch.cuda.current_device() if index is None else index
    major, minor = torch.cuda.get_device_capability(index)
    if major < 7:
        raise PersistentUnavailable(f"the loop naps with nanosleep, which needs compute capability 7.0+; "
                                    f"{torch.cuda.get_device_name(index)} is {major}.{minor}")
    cubin = _compile(major * 10 + minor)
    switch = (min(driver, runtime) >= SWITCH_CUDA and cuda.version >= (12, 8)
              and hasattr(cuda.driver.CUgraphConditionalNodeType, "CU_GRAPH_COND_TYPE_SWITCH"))
    return _Support(cuda, switch, cubin)


def _bindings() -> _Cuda:
    try:
        from cuda.bindings import driver, nvrtc, runtime
    except ImportError:
        try:  # cuda-python before the cuda-bindings split spells the modules so
            from cuda import cuda as driver
            from cuda import cudart as runtime
            from cuda import nvrtc
        except ImportError as e:
            raise PersistentUnavailable("cuda-python is not installed: pip install 'blink-serve[cuda]'") from e
    return _Cuda(driver, runtime, nvrtc, _binding_version())


def _binding_version() -> tuple[int, int]:
    for name in ("cuda-bindings", "cuda-python"):
        try:
            major, minor = importlib.metadata.version(name).split(".")[:2]
            return int(major), int(minor)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
    try:
        from cuda.bindings import __version__ as version

        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except (ImportError, ValueError):
        return 0, 0


@functools.cache
def _compile(arch: int) -> bytes:
    """The pick kernel as a cubin for sm_`arch`: a cubin (not PTX) loads on any driver of the same major version,
    where PTX from a newer NVRTC would not JIT on an older driver."""
    nvrtc = _bindings().nvrtc
    options = [f"--gpu-architecture=sm_{arch}", *PICK_DEFINES]
    try:
        program = _ok(nvrtc.nvrtcCreateProgram(_PICK.encode(), b"blink_pick.cu", 0, [], []), "nvrtcCreateProgram")
    except Exception as e:
        raise PersistentUnavailable(f"NVRTC is unavailable: {e}") from e
    try:
        (error,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        if int(error) != 0:
            text = bytearray(_ok(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize"))
            _ok(nvrtc.nvrtcGetProgramLog(program, text), "nvrtcGetProgramLog")
            raise PersistentUnavailable(f"NVRTC could not compile the loop's pick kernel for sm_{arch}: "
                                        f"{text.decode(errors='replace').strip(chr(0)).strip()}")
        cubin = bytearray(_ok(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize"))
        _ok(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return bytes(cubin)
    except PersistentUnavailable:
        raise
    except Exception as e:
        raise PersistentUnavailable(f"NVRTC failed: {e}") from e
    finally:
        nvrtc.nvrtcDestroyProgram(program)


class PersistentDriver(DeviceDriver):
    mode = "persistent"

    def __init__(self, step: DeviceStep, table: SlotTable):
        device = step.engine.device
        if device.type != "cuda":
            raise PersistentUnavailable("needs a CUDA GPU; the engine runs on the CPU")
        support = _support(device.index if device.index is not None else torch.cuda.current_device())
        from blink.engine.drive.graph import capture_buckets

        self.step, self.table, self.device = step, table, device
        self._cuda, self.switch = support.cuda, support.switch
        self._module = self._graph = self._exec = None
        started = time.perf_counter()
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)  # torch's streams do not wait on the legacy default stream
            self.graphs = capture_buckets(step, self.stream, keep_graph=True)
            self._stop = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self._origin_s = torch.zeros(1, dtype=torch.float64, device=device)
            self._origin_ns = torch.zeros(1, dtype=torch.int64, device=device)
            try:
                self._build(support.cubin)
            except Exception as e:
                self._release()
                raise PersistentUnavailable(f"building the persistent loop failed: {e}") from e
            torch.cuda.synchronize(device)  # the loop's buffers were set on other streams than its own
        self.launches = 0
        self._running = False
        log.info("persistent step loop built", buckets=step.buckets, branches="switch" if self.switch else "if-chain",
                 seconds=round(time.perf_counter() - started, 2))

    def start(self) -> None:
        """Launches the loop once; it runs until stop()."""
        if self._running:
            raise RuntimeError("the persistent loop is already running")
        d = self._cuda.driver
        with torch.cuda.device(self.device):
            self._stop.fill_(0)
            self.step.clock[0] = time.monotonic()  # the loop's clock starts here and follows the GPU's timer
            with torch.cuda.stream(self.stream):
                self._origin_ns.zero_()
            _ok(d.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            _ok(d.cuGraphLaunch(self._exec, d.CUstream(self.stream.cuda_stream)), "cuGraphLaunch")
        self._running = True
        self.launches += 1
        self.step.grammars.start()  # the loop has no host thread: the grammar gate brings its own

    def stop(self) -> None:
        """Returns once the loop has ended, after the step in flight: admitted requests stay resident and carry on
        at the next start()."""
        self._stop.fill_(1)
        self.stream.synchronize()
        self._running = False
        self.step.grammars.stop()

    def close(self) -> None:
        if self._running:
            self.stop()
        self._release()
        self.step.close()

    def _build(self, cubin: bytes) -> None:
        d, step, device = self._cuda.driver, self.step, self.device
        cond = d.CUgraphConditionalNodeType
        self._ctx = ctx = _ok(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if not int(ctx):
            raise RuntimeError("no current CUDA context")
        image = np.frombuffer(cubin, dtype=np.uint8).copy()
        self._module = _ok(d.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
        pick = _ok(d.cuModuleGetFunction(self._module, b"pick"), "cuModuleGetFunction")
        self._graph = graph = _ok(d.cuGraphCreate(0), "cuGraphCreate")
        n = len(step.buckets)

        def handle(default: int) -> Any:  # reset to `default` at each launch
            return _ok(d.cuGraphConditionalHandleCreate(graph, ctx, default, d.CU_GRAPH_COND_ASSIGN_DEFAULT),
                       "cuGraphConditionalHandleCreate")

        loop = handle(1)
        branches = [handle(n)] if self.switch else [handle(0) for _ in range(n)]
        handles = np.array([int(h) for h in (loop, *branches)], dtype=np.uint64)
        self._handles = torch.from_numpy(handles.view(np.int64)).to(device)
        self._buckets = torch.tensor(step.buckets, dtype=torch.int64, device=device)
        _, (body,) = self._conditional(graph, [], loop, cond.CU_GRAPH_COND_TYPE_WHILE, 1)

        table, S = step.table, step.table.geometry.num_slots
        fields = slot_dtype(table.geometry).fields
        values = [self._handles.data_ptr(), int(not self.switch), self._buckets.data_ptr(), n,
                  self._mapped(self._stop), step._demand.data_ptr(), step.inbox.fenced.data_ptr(),
                  step.inbox.epoch.data_ptr(), table.memory.data_ptr() + HEADER_BYTES, S, table.record_bytes,
                  fields["state"][1], fields["epoch"][1], fields["produced"][1], fields["consumed"][1],
                  fields["cancel"][1], table.geometry.window, self._mapped(step.clock), self._origin_s.data_ptr(),
                  self._origin_ns.data_ptr(), self._mapped(step.limit), self._mapped(step.grammars.ready),
                  fields["grammar_kind"][1]]
        self._values = np.array(values, dtype=np.uint64)
        self._args = np.array([self._values.ctypes.data + 8 * i for i in range(len(values))], dtype=np.uint64)
        params = d.CUDA_KERNEL_NODE_PARAMS()
        params.func = pick
        params.gridDimX = params.gridDimY = params.gridDimZ = 1
        params.blockDimX, params.blockDimY, params.blockDimZ = min(1024, max(32, -(-S // 32) * 32)), 1, 1
        params.sharedMemBytes = 0
        params.kernelParams = self._args.ctypes.data
        node = _ok(d.cuGraphAddKernelNode(body, [], 0, params), "cuGraphAddKernelNode")

        if self.switch:
            _, bodies = self._conditional(body, [node], branches[0], cond.CU_GRAPH_COND_TYPE_SWITCH, n)
        else:
            bodies = []
            for h in branches:  # a chain: one IF node after another, at most one of them taken
                node, (branch,) = self._conditional(body, [node], h, cond.CU_GRAPH_COND_TYPE_IF, 1)
                bodies.append(branch)
        for branch, bucket in zip(bodies, step.buckets, strict=True):
            child = d.CUgraph(self.graphs[bucket].raw_cuda_graph())
            _ok(d.cuGraphAddChildGraphNode(branch, [], 0, child), "cuGraphAddChildGraphNode")  # clones it
        self._exec = _ok(d.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def _conditional(self, graph: Any, after: list, handle: Any, kind: Any, size: int) -> tuple[Any, list]:
        """Adds a conditional node after `after`; returns it and its body graphs."""
        d = self._cuda.driver
        params = d.CUgraphNodeParams()
        params.type = d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = kind
        params.conditional.size = size
        params.conditional.ctx = self._ctx
        if self._cuda.version >= (13, 0):  # CUDA 13 gave cuGraphAddNode the edge data of cuGraphAddNode_v2
            node = _ok(d.cuGraphAddNode(graph, after, None, len(after), params), "cuGraphAddNode")
        else:
            node = _ok(d.cuGraphAddNode(graph, after, len(after), params), "cuGraphAddNode")
        # The bodies are on the params the call filled in, valid for the node's lifetime.
        return node, [params.conditional.phGraph_out[i] for i in range(size)]

    def _mapped(self, pinned: torch.Tensor) -> int:
        """The device address of pinned host memory (the host address itself under unified addressing)."""
        return int(_ok(self._cuda.driver.cuMemHostGetDevicePointer(pinned.data_ptr(), 0), "cuMemHostGetDevicePointer"))

    def _release(self) -> None:
        d = self._cuda.driver
        if self._exec is not None:
            d.cuGraphExecDestroy(self._exec)
        if self._graph is not None:
            d.cuGraphDestroy(self._graph)
        if self._module is not None:
            d.cuModuleUnload(self._module)
        self._module = self._graph = self._exec = None


def _ok(result: tuple, what: str) -> Any:
    """The values of a cuda-python call, which returns (error, *values); every API spells success 0."""
    error, *values = result
    if int(error) != 0:
        raise RuntimeError(f"{what} failed: {getattr(error, 'name', error)}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


def _dotted(version: int | tuple[int, int]) -> str:
    if isinstance(version, tuple):
        return ".".join(map(str, version))
    return f"{version // 1000}.{version % 1000 // 10}"
