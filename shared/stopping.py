"""Stopping a service on SIGTERM or SIGINT, safely.

A signal handler runs on the main thread between two bytecodes, possibly inside code that holds a lock. Setting a
`threading.Event` from it takes the event's lock: a second signal arriving while the first handler is inside
`Event.set` (a parent's death signal and a supervisor's SIGTERM, back to back) then waits on that lock for good, and
the process never exits (seen: an engine hung at shutdown about one time in eight). So the handler sets a plain
attribute, and the loops that stop on it poll it.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time


class StopFlag:
    """Set by SIGTERM or SIGINT once `install()`ed, or by `set()`; read by any thread."""

    def __init__(self) -> None:
        self._set = False

    def install(self) -> StopFlag:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        self._set = True  # no lock: see the module's docstring

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout_s: float, poll_s: float = 0.005) -> bool:
        """Sleeps until set or `timeout_s` passed; returns whether it is set."""
        deadline = time.monotonic() + timeout_s
        while not self._set and time.monotonic() < deadline:
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        return self._set


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """In a child: `sig` when its parent dies, even by SIGKILL (Linux only; elsewhere a no-op)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def terminate(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM (a service drains on it), then SIGKILL once `grace_s` passed; returns when the process is gone."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
