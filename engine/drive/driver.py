"""The one interface of the drive modes over the slot table: what the engine service holds, whichever mode steps.

A driver steps the engine by itself once started: the `host` mode in a host thread, `graph` in a thread that
replays captured steps, `persistent` on the GPU. The service never asks which one it holds: it starts it, stops
it, reads how many requests are resident, sets the admission limit, and learns of a driver that failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from blink.engine.core.rotation import HostMirror


class Fenced(RuntimeError):
    """The table moved to a newer epoch: a watchdog declared this engine dead and another took over."""


class Driver(Protocol):
    mode: str  # host | graph | persistent
    # What this mode does not do (yet), in words: logged at start-up and shown by /ready. Never silently off.
    limitations: tuple[str, ...]
    mirror: HostMirror | None  # where preempted requests' KV pages rotate; None: they are recomputed

    def start(self) -> None:
        """Steps from now on, by itself."""

    def stop(self) -> None:
        """Returns after the step in flight: what it wrote is whole, admitted requests stay resident."""

    def close(self) -> None:
        """Gives back what the mode holds (graphs, the table's device mapping); after stop()."""

    @property
    def resident(self) -> int:
        """Requests admitted and not finished."""

    def idle(self) -> bool:
        """Nothing to step for: nothing resident and nothing published, or every resident request waits for its
        reader. The service vouches for an idle driver, which takes no steps, to the watchdog."""

    def set_admission_limit(self, limit: int | None) -> None:
        """Most requests resident at once, from the next step on; None: every slot."""

    @property
    def failure(self) -> BaseException | None:
        """Why the driver stopped stepping by itself (Fenced: another engine owns the table), else None."""

    def progress(self) -> int:
        """A count that moves while the driver works: steps taken, and in the host mode the sublayers run inside
        a step too. The service vouches for a driver whose count moves, to the watchdog."""
