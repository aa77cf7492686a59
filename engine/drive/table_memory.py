"""The slot table's memory, addressable by the engine's device.

On the CPU the mapping itself. On CUDA the shared-memory segment is page-locked and mapped into the device's
address space (`cudaHostRegister` with `cudaHostRegisterMapped`), so kernels read the ingress's records and write
tokens back with no engine-side host copy.
"""

from __future__ import annotations

import numpy as np
import torch

from blink.shared.slot_table import SlotTable

_REGISTER_PORTABLE, _REGISTER_MAPPED = 1, 2


class TableMemory:
    """Owns the device view of a table's mapping; `close()` unregisters it (before the table is closed)."""

    def __init__(self, table: SlotTable, device: torch.device):
        self._host = np.frombuffer(table.mapping, dtype=np.uint8)
        self.device, self._registered = device, False
        if device.type == "cpu":
            self.tensor = torch.from_numpy(self._host)
            return
        pointer, size = self._host.ctypes.data, self._host.nbytes
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device):
            error = cudart.cudaHostRegister(pointer, size, _REGISTER_PORTABLE | _REGISTER_MAPPED)
            if int(error) != 0:
                _clear_last_error()
                raise RuntimeError(f"cudaHostRegister of the slot table failed (error {int(error)}: "
                                   f"{cudart.cudaGetErrorString(error)}): the device cannot map it")
            self._registered = True
            self.tensor = torch.as_tensor(_CudaArray(_device_pointer(pointer), (size,), "|u1"), device=device)

    def close(self) -> None:
        """Idempotent."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._host.ctypes.data)
            self._registered = False
        self.tensor = self._host = None


def device_alias(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`pinned` (page-locked host memory) as a tensor on `device` over the same bytes: kernels read what the host
    wrote last and write what the host reads, with no copy to enqueue (on the CPU: `pinned` itself). The caller
    keeps `pinned` alive as long as the alias."""
    if device.type == "cpu":
        return pinned
    assert pinned.is_contiguous()
    # As bytes, viewed back: numpy, whose type strings the interface speaks, has no bfloat16 or float8 (FP8 pages).
    raw = torch.as_tensor(_CudaArray(_device_pointer(pinned.data_ptr()), (pinned.nbytes,), "|u1"), device=device)
    return raw.view(pinned.dtype).view(pinned.shape)


class _CudaArray:
    """Lets torch wrap device-addressable memory it did not allocate."""

    def __init__(self, pointer: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (pointer, False),
                                         "strides": None, "version": 3}


def _device_pointer(host_pointer: int) -> int:
    """The device address of registered host memory: the same address under unified addressing (every 64-bit
    Linux CUDA device that can use host pointers for registered memory); cuda-python asks the runtime when present."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return host_pointer
    error, pointer = runtime.cudaHostGetDevicePointer(host_pointer, 0)
    if error != runtime.cudaError_t.cudaSuccess:
        runtime.cudaGetLastError()
        raise RuntimeError(f"cudaHostGetDevicePointer failed: {error}")
    return int(pointer)


def _clear_last_error() -> None:
    """Resets the runtime's last error after a failed call that was handled here, or torch's next launch check
    raises it against an unrelated kernel (seen on an H100: a failed register surfaced at the next weight copy).
    Needs cuda-python; without it the error stays pending and the next CUDA call names it."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return
    runtime.cudaGetLastError()
