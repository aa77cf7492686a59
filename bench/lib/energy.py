"""GPU energy over a run, from NVML: power sampled on a thread and integrated, for every GPU this host has.

Where the driver keeps a total-energy counter (Volta and later), its difference over the run is reported too;
it is the more exact of the two. Energy is that of every GPU on this host (CUDA_VISIBLE_DEVICES does not narrow
NVML), so it means something when the server under test runs here and has the GPUs to itself.
"""

from __future__ import annotations

import threading
import time

import numpy as np


def integrate(samples: list[tuple[float, float]]) -> float:
    """Joules from (seconds, watts) samples, by the trapezoid rule; 0 with fewer than two samples."""
    if len(samples) < 2:
        return 0.0
    t, w = np.asarray(samples, dtype=float).T
    return float(np.sum((w[1:] + w[:-1]) / 2 * np.diff(t)))


class EnergyMeter:
    """`with EnergyMeter() as meter: ...`; then `meter.result(output_tokens)`; `available` is False (and
    `reason` says why) where NVML cannot be used."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.available, self.reason = False, None
        self.samples: list[list[tuple[float, float]]] = []
        self._counters_start: list[int | None] = []
        self._counters_end: list[int | None] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = bool(self._handles)
            self.reason = None if self._handles else "NVML sees no GPU"
        except Exception as e:  # no nvidia-ml-py, no driver, no device
            self.reason = f"NVML unavailable: {e}"

    def __enter__(self) -> EnergyMeter:
        if self.available:
            self.samples = [[] for _ in self._handles]
            self._counters_start = [self._energy_mj(h) for h in self._handles]
            self._thread = threading.Thread(target=self._sample, name="nvml-power", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._counters_end = [self._energy_mj(h) for h in self._handles]
        if self.available:
            self._nvml.nvmlShutdown()

    def _sample(self) -> None:
        try:
            while True:
                now = time.perf_counter()
                for samples, handle in zip(self.samples, self._handles, strict=True):
                    samples.append((now, self._nvml.nvmlDeviceGetPowerUsage(handle) / 1000))
                if self._stop.wait(self.interval_s):
                    return
        except self._nvml.NVMLError as e:  # the figure would cover part of the run: report none
            self.reason = f"power sampling failed: {e}"

    def _energy_mj(self, handle) -> int | None:
        try:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except self._nvml.NVMLError:
            return None

    def result(self, output_tokens: int) -> dict[str, object]:
        if not self.available or self.reason:
            return {"available": False, "reason": self.reason}
        sampled = sum(integrate(s) for s in self.samples)
        counters = [(b - a) / 1000 for a, b in zip(self._counters_start, self._counters_end, strict=True)
                    if a is not None and b is not None]
        joules = sum(counters) if len(counters) == len(self._handles) else sampled
        seconds = max((s[-1][0] - s[0][0] for s in self.samples if len(s) > 1), default=0.0)
        return {"available": True, "gpus": len(self._handles), "joules": joules, "joules_sampled": sampled,
                "joules_counter": sum(counters) if counters else None,
                "mean_watts": joules / seconds if seconds else None,
                "power_samples": sum(len(s) for s in self.samples),
                "joules_per_output_token": joules / output_tokens if output_tokens else None}
