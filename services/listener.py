"""The HTTP port of `blink serve`: bound once, by `blink serve`, and handed to every ingress it starts.

An ingress that binds the port itself lets go of it whenever it restarts: clients are refused meanwhile, and a
process that takes the port then leaves every later ingress failing to bind, restarted by the watchdog for ever.
Held by `blink serve`, the port is taken before the engine loads (one in use is an error at once), stays taken
across ingress restarts, and connections that arrive meanwhile wait in its backlog for the next ingress. An
ingress started any other way (`blink ingress`, an orchestrator's) binds the port itself.
"""

from __future__ import annotations

import os
import socket

ENV = "BLINK_LISTEN_FD"  # the inherited socket's descriptor, in the ingress's environment
BACKLOG = 2048  # uvicorn's own default


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, as uvicorn would make it; OSError if the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def inherited() -> socket.socket | None:
    """The socket `blink serve` handed this process, if it did."""
    fd = os.environ.get(ENV)
    return socket.socket(fileno=int(fd)) if fd else None
