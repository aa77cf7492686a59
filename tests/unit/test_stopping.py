"""The services' stop flag: set by SIGTERM and SIGINT, any number of them, without a lock in the handler."""

from __future__ import annotations

import os
import signal

from blink.shared.stopping import StopFlag


def test_signals_back_to_back_set_the_flag():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = StopFlag().install()
        assert not stop.is_set() and not stop.wait(0.01)
        for _ in range(3):  # a parent's death signal and a supervisor's SIGTERM, back to back
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(1.0)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
