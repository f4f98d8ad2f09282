"""The real HTTP server as a subprocess, for the tests/test_server_*.py modules.

`sglite_server` (session scope) is registered through tests/conftest.py so every module shares
one server; `ServerProcess` starts extra instances (API key, SIGTERM) where a test needs its own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import requests

STARTUP_TIMEOUT = 300.0


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m sglite.launch_server` on a loopback port (a free one unless given), stopped with
    SIGTERM."""

    def __init__(
        self,
        *extra_args: str,
        api_key: str | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [
            sys.executable, "-m", "sglite.launch_server", "--port", str(self.port),
            "--dtype", "float32", "--max-total-tokens", "8192", "--log-level", "warning",
            # The float activations: outputs compared exactly across batches, cache hits and
            # retractions (int8 rounds decode only, so those can differ; conftest.py).
            "--gguf-activations", "float",
            *extra_args,
        ]  # fmt: skip
        if api_key:
            args += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile(prefix="sglite-server-", suffix=".log", delete=False)
        environment = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, env=environment
        )
        self._wait_ready()

    @property
    def headers(self) -> dict[str, str]:
        """Authorization headers for this server (empty without an API key)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        """Everything the server printed so far."""
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited during start-up:\n{self.output()[-4000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the server did not become healthy:\n{self.output()[-4000:]}")

    def child_pids(self) -> list[int]:
        """Pids of the server's child processes (the scheduler)."""
        pids: list[int] = []
        task_dir = f"/proc/{self.proc.pid}/task"
        for tid in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{tid}/children") as f:
                    pids += [int(p) for p in f.read().split()]
            except OSError:
                pass
        return pids

    def scheduler_pids(self) -> list[int]:
        """Pids of the server's scheduler processes: other children (a short-lived helper a
        library runs, such as a compiler or ldconfig probe) are left out."""
        pids = []
        for pid in self.child_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"sglite.runtime.scheduler.process" in argv:
                pids.append(pid)
        return pids

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait, SIGKILL as a last resort; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def sglite_server():
    """The default model served over HTTP (float32, 16k-token pool), shared by the session."""
    server = ServerProcess()
    yield server
    code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.output()[-4000:]}"
