"""The transports by which the ingress reaches the engine's slot table, declared once: settings (--transport),
`blink doctor`, the ingress (blink.ingress.connect), the engine service and the watchdog read them here. A new one is
an entry below and its client's file."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Transport:
    name: str
    summary: str  # what it is, for --transport's help
    client: str  # "module:function" opening the ingress's client; it raises NoPath where there is no path
    check: Callable[[str | None], tuple[bool, str]]  # blink doctor's: (available here, why), given --rdma-device
    when: str = ""  # for auto's help, where auto takes it only under a condition of its own
    falls_back_to: str | None = None  # where the ingress goes when it was asked for by name and has no path
    degraded: bool = False  # a fallback: /ready and the metrics say so


def _shm(rdma_device: str | None) -> tuple[bool, str]:
    from blink.shared.slot_table import SHM_DIR

    if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK):
        return True, f"{SHM_DIR} is writable: an ingress on this host maps the table"
    return False, f"{SHM_DIR} is missing or not writable"


def _rdma(rdma_device: str | None) -> tuple[bool, str]:
    from blink.shared.rdma import RdmaUnavailable, pick_device

    try:
        name = pick_device(rdma_device)
    except RdmaUnavailable as e:
        return False, str(e)
    return True, (f"pyverbs and RDMA device {name}: the ingress writes requests into the table with one-sided RDMA "
                  "(its port and link are checked when it connects)")


def _zmq(rdma_device: str | None) -> tuple[bool, str]:
    return True, "always: the engine host relays requests over ZeroMQ (degraded: the engine host's CPU copies each one)"


# In the order `auto` tries them.
TRANSPORTS = {t.name: t for t in (
    Transport("shm", "same host", "blink.ingress.slots:connect", _shm, when="when the table is here"),
    Transport("rdma", "one-sided RDMA through the NIC", "blink.ingress.rdma_link:connect", _rdma,
              falls_back_to="zmq"),
    Transport("zmq", "relayed by the engine host", "blink.ingress.remote_slots:connect", _zmq, degraded=True),
)}
NAMES = tuple(TRANSPORTS)
LAST_RESORT = NAMES[-1]  # always has a path: where the watchdog moves an ingress whose path is lost

HELP = ("how the ingress reaches the slot table: "
        + ", ".join(f"{t.name} ({t.summary}{'; degraded' if t.degraded else ''})" for t in TRANSPORTS.values())
        + ", auto (" + ", else ".join(" ".join(filter(None, (t.name, t.when))) for t in TRANSPORTS.values()) + ")")


def chain(setting: str) -> list[str]:
    """The transports an ingress with --transport `setting` tries, in order: `auto`, all of them; a name, that one
    and what it falls back to."""
    if setting == "auto":
        return list(NAMES)
    fallback = TRANSPORTS[setting].falls_back_to
    return [setting, *(chain(fallback) if fallback else ())]


def may_use(setting: str, name: str) -> bool:
    """Whether a deployment with --transport `setting` may end up on `name` (the engine serves only those)."""
    return name in chain(setting)
