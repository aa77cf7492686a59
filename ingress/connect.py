"""Opens the ingress's client: the first transport of the deployment's --transport (blink.shared.transports) that has a
path to the engine from here."""

from __future__ import annotations

import importlib
import itertools

import structlog

from blink.ingress.client import IngressClient, NoPath
from blink.shared import sockets, transports
from blink.shared.control import EngineInfo
from blink.shared.settings import Settings

log = structlog.get_logger()


def open_client(name: str, settings: Settings, keys: sockets.Keys, info: EngineInfo) -> IngressClient:
    """The client of transport `name`, not yet started; raises NoPath where it has no path to the engine."""
    module, function = transports.TRANSPORTS[name].client.split(":")
    return getattr(importlib.import_module(module), function)(settings, keys, info)


def connect(settings: Settings, keys: sockets.Keys, info: EngineInfo) -> IngressClient:
    """The slot table in shared memory when it is on this host (and not fed by the relay); else one-sided RDMA into
    it through the NIC; else the engine host's relay over ZeroMQ (degraded): --transport's chain, in that order."""
    names = transports.chain(settings.transport)
    for name, after in itertools.pairwise(names):
        try:
            return open_client(name, settings, keys, info)
        except NoPath as e:
            degraded = transports.TRANSPORTS[after].degraded
            (log.warning if degraded else log.info)(
                f"no {name} path to the engine" + (f": degraded to the {after} transport" if degraded else ""),
                reason=str(e))
    return open_client(names[-1], settings, keys, info)
