"""A `blink serve` subprocess on a free port, for benchmarks and tests that talk to it as clients do."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    zmq_endpoint: str
    control_endpoint: str
    deployment: str
    runtime_dir: Path

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.runtime_dir}/blink-{self.deployment}-{name}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(tmp_path, *flags: str, timeout_s: float = 120):
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
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.2)
        yield Server(url, proc, f"ipc://{tmp_path}/blink-{deployment}-api",
                     f"ipc://{tmp_path}/blink-{deployment}-control", deployment, Path(tmp_path))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
