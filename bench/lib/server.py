"""A `blink serve` subprocess on a free port, for benchmarks and tests that talk to it as clients do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import httpx

from blink.shared.settings import Settings
from blink.shared.stopping import terminate


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    settings: Settings  # the deployment's, as its services read them

    @property
    def deployment(self) -> str:
        return self.settings.deployment

    @property
    def runtime_dir(self) -> Path:
        return Path(self.settings.runtime_dir)

    @property
    def zmq_endpoint(self) -> str:
        return self.settings.zmq_endpoint

    @property
    def control_endpoint(self) -> str:
        return self.settings.control_endpoint

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.settings.private_dir}/{name}"

    @cached_property
    def keys(self):
        from blink.shared.sockets import load_keys

        return load_keys(self.settings)

    def request(self, endpoint: str, message, timeout_s: float = 1.0):
        """A control-plane request as a member of the deployment (its key)."""
        from blink.shared import control

        return control.request(endpoint, message, self.keys, timeout_s)


def _settings(flags: list[str]) -> Settings:
    """The deployment's settings, read from `blink serve`'s flags as the services read them."""
    import argparse

    from blink.services.cli import add_settings_flags, settings_from_args

    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    return settings_from_args(parser.parse_args(flags))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(tmp_path, *flags: str, timeout_s: float = 300):  # a loaded CI machine: a hang still fails
    port = free_port()
    deployment = f"test-{uuid.uuid4().hex[:10]}"
    cmd = [sys.executable, "-m", "blink.services.cli", "serve", "--port", str(port),
           "--deployment", deployment, "--runtime-dir", str(tmp_path), *flags]
    log = open(tmp_path / f"serve-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, (tmp_path / f"serve-{port}.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, ("server did not become ready: "
                                                 + (tmp_path / f"serve-{port}.log").read_text()[-6000:])
            time.sleep(0.2)
        yield Server(url, proc, _settings(cmd[4:]))
    finally:
        terminate(proc, 30)
        log.close()
