"""The control plane's sockets: where they live and who may talk to them.

Every control, relay and event socket of a deployment speaks ZeroMQ's CURVE: the serving side accepts a peer only if
it proves it holds the deployment's key (a ZAP handler checks the client's public key), and every frame is
encrypted and authenticated, so a stranger who can reach a port can neither send an order nor replay one. All
services of a deployment share one key pair: whoever can read the key file is part of the deployment.

The key is, in order: `--control-key` (`BLINK_CONTROL_KEY`, the z85 secret key, 40 characters), the file
`--control-key-file` names (compose: a secret), or `control.key` in the deployment's private directory, written
there on first start. That directory (mode 0700, under `$XDG_RUNTIME_DIR` or `--runtime-dir`) also holds the IPC
socket files, so no other user can open them; `blink serve` removes it when the stack stops.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from blink.shared.settings import Settings

log = structlog.get_logger()
KEY_FILE = "control.key"
CONTROL_FRAME_BYTES = 1 << 20  # the largest control message a server reads; beyond it libzmq drops the peer


@dataclass(frozen=True)
class Keys:
    """The deployment's CURVE key pair, z85-encoded."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> Keys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def from_secret(cls, secret: str | bytes) -> Keys:
        secret = (secret.encode() if isinstance(secret, str) else secret).strip()
        if len(secret) != 40:
            raise ValueError("a control key is a z85-encoded CURVE secret key: 40 characters (`blink keygen`)")
        try:
            return cls(zmq.curve_public(secret), secret)
        except (ValueError, zmq.ZMQError) as e:
            raise ValueError(f"not a z85-encoded CURVE secret key: {e}") from None


def private_dir(settings: Settings, create: bool = False) -> Path:
    """The deployment's runtime directory, checked to be this user's alone (made, mode 0700, when `create`)."""
    path = settings.private_dir
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    try:
        info = path.lstat()
    except FileNotFoundError:
        if create:
            raise
        return path  # not made yet: whoever starts first makes it
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of this user's: pick another --runtime-dir or --deployment")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours, but open to others (made by hand, or by an older Blink): close it
    return path


def write_key(path: Path, keys: Keys | None = None) -> Keys:
    """Writes a new key file (0600); FileExistsError if there is one. Whole or not at all: a service starting beside
    this one never reads half a key."""
    keys = keys or Keys.generate()
    draft = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(keys.secret + b"\n")
        os.link(draft, path)
    finally:
        draft.unlink(missing_ok=True)
    return keys


def load_keys(settings: Settings, create: bool = False) -> Keys:
    """The deployment's keys (see the module's docstring). `create` (the services that start a deployment; clients
    only read): make the private directory, and its key when none is given and there is none yet."""
    directory = private_dir(settings, create)  # the IPC sockets' home, whichever key is used
    if settings.control_key is not None:
        return Keys.from_secret(settings.control_key.get_secret_value())
    path = Path(settings.control_key_file) if settings.control_key_file else directory / KEY_FILE
    if create and not settings.control_key_file:
        with contextlib.suppress(FileExistsError):
            write_key(path)
    try:
        info = path.stat()
        secret = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"no control key at {path}: start the deployment first, or give --control-key-file "
                                "(`blink keygen FILE` writes one)") from None
    if info.st_mode & 0o077:
        log.warning("the control key file is readable by other users", path=str(path), mode=oct(info.st_mode & 0o777))
    return Keys.from_secret(secret)


class _Allowed:
    """The ZAP handler's question: is this client one of the deployment's? Logs every stranger it turns away."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self.keys:
            return True
        log.warning("control plane: refused a peer without the deployment's key", client_key=client_key.decode())
        return False


_auth_lock = threading.Lock()
_authenticators: dict[int, tuple[ThreadAuthenticator, _Allowed]] = {}


def _allow(context: zmq.Context, keys: Keys) -> None:
    """One ZAP handler per libzmq context (an asyncio context shares its handler through a sync shadow)."""
    with _auth_lock:
        entry = _authenticators.get(context.underlying)
        if entry is None:
            authenticator = ThreadAuthenticator(zmq.Context.shadow(context.underlying))
            authenticator.start()
            allowed = _Allowed()
            authenticator.configure_curve_callback("*", allowed)
            entry = _authenticators[context.underlying] = (authenticator, allowed)
        entry[1].keys.add(keys.public)


def bind(sock: zmq.Socket, endpoint: str, keys: Keys, max_frame_bytes: int = CONTROL_FRAME_BYTES) -> None:
    """Serves `endpoint` to the deployment's members only; a peer sending a larger frame is disconnected."""
    _allow(sock.context, keys)
    sock.curve_server = True
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.bind(endpoint)
    _log_refusals(sock, endpoint)


_HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                       | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _log_refusals(sock: zmq.Socket, endpoint: str) -> None:
    """Logs every peer whose handshake failed (no CURVE, a wrong server key, a refused client key): what a stranger
    sent never reaches the socket, but the attempt is on record."""
    address = f"inproc://blink-monitor-{id(sock)}"
    sock.monitor(address, _HANDSHAKE_FAILURES)

    def watch() -> None:
        monitor = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        monitor.connect(address)
        try:
            while True:
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                log.warning("control plane: refused a peer", endpoint=endpoint,
                            reason=zmq.Event(event["event"]).name.lower(), detail=event["value"])
        except zmq.ZMQError:
            return  # the context is ending
        finally:
            monitor.close(linger=0)

    threading.Thread(target=watch, name=f"refusals {endpoint}", daemon=True).start()


def connect(sock: zmq.Socket, endpoint: str, keys: Keys) -> None:
    """Connects as a member of the deployment: the server must hold its key too (CURVE checks both ends)."""
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.connect(endpoint)


def unlink_ipc(endpoint: str) -> None:
    """libzmq leaves a bound IPC socket's file behind when the socket closes."""
    if endpoint.startswith("ipc://"):
        Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
