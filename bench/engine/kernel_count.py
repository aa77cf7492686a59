"""A step's work counted as the GPU kernels a replay of its captured graph launches, and as the bytes its ops touch.

Kernels, by what runs (`KernelCounter`, active as a torch dispatch mode, with `triton_launches` and `as_one_kernel`):

- a Triton launch (`kernel[grid](...)`, hooked at `JITFunction.run` and the interpreter's `InterpretedFunction.run`)
  is 1, whatever its grid or work; the tensor ops its interpreter runs to copy the arguments are none;
- an aten op that computes or moves data is 1: copies and casts, fills (`zeros`, `full`, `zero_`), `arange`,
  elementwise and reduction ops, index/gather/scatter, sort/topk/cumsum, matrix products;
- an op that only makes a tensor's metadata is 0: views (`view`, `slice`, `select`, `expand`, `transpose`...,
  whatever `func.is_view` says, when the output lies in the input's memory: `to` may alias or copy), `empty*`,
  `set_`, `resize_`; so is an op whose outputs hold no element (CUDA launches nothing for them) and one that
  returns no tensor (`promote_types`; a host read, `HOST_READS`, is counted apart: a captured step has none);
- a projection (`linear`, `as_one_kernel`) is 1: cuBLAS's product, whatever the CPU runs in its place.

Where CUPTI can count more: cuBLAS may split a product over 2 kernels (split-K and its reduction); sort, topk,
cumsum, nonzero and `index_put_(accumulate=True)` run as several CUB/ATen kernels on CUDA (`MULTI` lists them and
each row reports how many such ops it counted as 1); an op on a 0-dimensional host scalar is counted though a GPU
may run it on the host. Where it can count fewer: the step is counted eager, so the fused kernels of
`--compile-bookkeeping` are not what it counts. Ops are attributed to the phase `phase` set when they run.

Bytes (the older figure): each op's tensors' sizes, except that a view moves nothing and an indexed read or write
(index, index_put_, scatter_...) touches the rows it names, not the whole tensor it indexes; `bytes_paused` leaves
out what a caller says the GPU does not do that way.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

NO_KERNEL = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
             "aten.empty_permuted", "aten.set_", "aten.resize_", "aten.resize_as_", "aten.record_stream",
             "aten.is_same_size", "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset"}
# A value read on the host: a sync, which a captured step cannot hold (`blink bench step` makes the step take the
# GPU's path, where `state.none_set` reads nothing); counted apart, as no kernel.
HOST_READS = {"aten.is_nonzero", "aten._local_scalar_dense", "aten.equal"}
# Counted as 1, launched on CUDA as several (CUB's radix sort and scan passes, nonzero's count and copy, an
# accumulating index_put_'s sort) or sometimes 2 (cuBLAS's split-K).
MULTI = {"aten.sort", "aten.argsort", "aten.topk", "aten.cumsum", "aten.cumprod", "aten.nonzero", "aten.unique",
         "aten._unique2", "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.masked_select",
         "aten.kthvalue", "aten.median", "aten.scatter_reduce", "aten.index_put_", "aten._index_put_impl_",
         "cublas.linear"}
_INDEXED_READS = {"aten.index", "aten.gather", "aten.index_select"}
_INDEXED_WRITES = {"aten.index_put_", "aten._index_put_impl_", "aten.scatter_", "aten.scatter_add_",
                   "aten.index_copy_", "aten.index_fill_"}


class KernelCounter:
    """Kernels per phase (and per op within it) and bytes, of the tensor ops dispatched while it is active."""

    def __init__(self, phase: str = "bookkeeping") -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not counter.in_launch:
                    counter.record(func, args, kwargs or {}, out)
                return out

        self.mode = Mode()
        self.phase = phase
        self.in_launch = False  # inside a Triton launch or a counted-as-one call: its own ops are not kernels
        self.bytes_paused = False
        self.kernels: Counter[str] = Counter()  # phase -> kernels
        self.kernel_ops: dict[str, Counter[str]] = {}  # phase -> op -> kernels
        self.multi: Counter[str] = Counter()  # phase -> kernels counted as 1 that CUDA may run as several
        self.host_reads: Counter[str] = Counter()  # phase -> values read on the host (none in a captured step)
        self.ops = 0  # aten ops counted for bytes
        self.bytes = 0
        self.by_op: dict[str, list[int]] = {}

    def kernel(self, name: str, n: int = 1) -> None:
        self.kernels[self.phase] += n
        self.kernel_ops.setdefault(self.phase, Counter())[name] += n
        if name in MULTI:
            self.multi[self.phase] += n

    def add(self, name: str, ops: int, nbytes: int) -> None:
        self.ops += ops
        self.bytes += nbytes
        entry = self.by_op.setdefault(name, [0, 0])
        entry[0] += ops
        entry[1] += nbytes

    def record(self, func, args: tuple, kwargs: dict, out) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        name = str(func.overloadpacket)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in HOST_READS:
            self.host_reads[self.phase] += 1
        elif outputs and not (name in NO_KERNEL or all(t.numel() == 0 for t in outputs)
                              or (func.is_view and _aliases(outputs, args, kwargs))):
            self.kernel(name)
        if self.bytes_paused:
            return

        def size(*values) -> int:
            return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))

        if func.is_view:
            nbytes = 0  # a new shape over the same memory
        elif name in _INDEXED_READS:
            nbytes = size(args[1:], kwargs) + 2 * size(out)  # the rows read, the indices, the rows written
        elif name in _INDEXED_WRITES:
            nbytes = 2 * size(args[1:], kwargs)  # the indices and values, read; as many elements updated
        else:
            nbytes = size(args, kwargs, out)
        self.add(name, 1, nbytes)

    def summary(self) -> dict[str, object]:
        return {"kernels": dict(self.kernels), "kernel_ops": {phase: dict(ops.most_common())
                                                              for phase, ops in self.kernel_ops.items()},
                "kernels_multi": dict(self.multi), "host_reads": dict(self.host_reads)}

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _aliases(outputs: list, args: tuple, kwargs: dict) -> bool:
    """Whether every output lies in an input's memory: a view (`aten.to` and its kin, which may alias, copy when
    the dtype or device changes)."""
    import torch
    from torch.utils._pytree import tree_leaves

    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in inputs for t in outputs)


@contextmanager
def _patched(owner, name: str, wrap):
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def triton_launches(counter: KernelCounter):
    """Every launch of a `@triton.jit` kernel counts 1 (a kernel calling another `@triton.jit` function inlines it:
    that is no launch), named `triton.<kernel>`; interpreted, the launch's argument copies count nothing."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def wrap(run):
        def counted(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return run(self, *args, **kwargs)
            counter.kernel(f"triton.{getattr(self, '__name__', 'kernel')}")
            outer, counter.in_launch = counter.in_launch, True
            try:
                return run(self, *args, **kwargs)
            finally:
                counter.in_launch = outer
        return counted

    with _patched(InterpretedFunction, "run", wrap), _patched(JITFunction, "run", wrap):
        yield


@contextmanager
def as_one_kernel(counter: KernelCounter, owner, name: str, label: str):
    """`owner.name` counts 1 kernel per call, named `label`, whatever it runs here (a projection: one cuBLAS
    product on the GPU, a C++ kernel or a split product on the CPU)."""
    def wrap(fn):
        def counted(*args, **kwargs):
            if counter.in_launch:
                return fn(*args, **kwargs)
            counter.kernel(label)
            counter.in_launch = True
            try:
                return fn(*args, **kwargs)
            finally:
                counter.in_launch = False
        return counted

    with _patched(owner, name, wrap):
        yield


@contextmanager
def phase(counter: KernelCounter, owner, name: str, label: str, count_bytes: bool = True):
    """Kernels of `owner.name`'s calls are counted under `label`; count_bytes=False leaves their bytes out."""
    def wrap(fn):
        def attributed(*args, **kwargs):
            outer, outer_paused = counter.phase, counter.bytes_paused
            counter.phase, counter.bytes_paused = label, outer_paused or not count_bytes
            try:
                return fn(*args, **kwargs)
            finally:
                counter.phase, counter.bytes_paused = outer, outer_paused
        return attributed

    with _patched(owner, name, wrap):
        yield


@contextmanager
def bytes_paused(counter: KernelCounter, owner, names: tuple[str, ...]):
    """These attributes of `owner` run with their bytes uncounted (their kernels still count)."""
    from contextlib import ExitStack

    def wrap(fn):
        def paused(*args, **kwargs):
            outer, counter.bytes_paused = counter.bytes_paused, True
            try:
                return fn(*args, **kwargs)
            finally:
                counter.bytes_paused = outer
        return paused

    with ExitStack() as stack:
        for name in names:
            stack.enter_context(_patched(owner, name, wrap))
        yield
