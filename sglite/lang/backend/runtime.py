"""`sgl.Runtime(...)`: start the HTTP server in a child process and talk to it.

Like SGLang's `Runtime`, it exposes `.url` and `.endpoint` (a `RuntimeEndpoint`), so
`sgl.set_default_backend(runtime)` works, and it shuts the server down at `shutdown()`, when used
as a context manager, or when this process exits (the server also dies with its parent).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from sglite.lang.backend.runtime_endpoint import RuntimeEndpoint


def _free_port(start: int) -> int:
    for port in range(start, 65536):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port at or above {start}")


def _die_with_parent() -> None:  # runs in the child before exec (Linux only; else a no-op)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def server_flags(**kwargs: Any) -> list[str]:
    """Command-line flags of `python -m sglite.launch_server` for server options as keywords
    (`max_total_tokens=4096` -> `--max-total-tokens 4096`). Unknown names raise TypeError."""
    from sglite.runtime.server_args import ServerArgs

    ServerArgs.from_kwargs(**kwargs)  # validates names and values before a process starts
    defaults = ServerArgs()
    flags: list[str] = []
    for name, value in kwargs.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            # Switches off by default are plain flags; those on by default have a --no- form.
            if value != getattr(defaults, name):
                flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


class Runtime:
    """The sglite server in a child process (`python -m sglite.launch_server`).

    Keywords are the server's options (`model_path`, `dtype`, `max_total_tokens`, ...; see
    `ServerArgs`). `port` is the first port tried. Blocks until `/health` answers; raises
    RuntimeError with the server's output if it exits or does not become healthy in
    `startup_timeout` seconds.
    """

    def __init__(
        self,
        log_level: str = "error",
        *,
        port: int = 30000,
        host: str = "127.0.0.1",
        startup_timeout: float = 600.0,
        **kwargs: Any,
    ) -> None:
        self.port = _free_port(port)
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.generate_url = self.url + "/generate"
        self.api_key: str | None = kwargs.get("api_key")
        args = [
            sys.executable, "-m", "sglite.launch_server",
            *server_flags(log_level=log_level, host=host, port=self.port, **kwargs),
        ]  # fmt: skip
        self._log = tempfile.NamedTemporaryFile(prefix="sglite-runtime-", suffix=".log")
        self._proc: subprocess.Popen | None = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self.pid: int | None = self._proc.pid
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(startup_timeout)
            self.endpoint = RuntimeEndpoint(self.url, api_key=self.api_key)
        except BaseException:
            self.shutdown()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"the server exited during start-up:\n{self.output()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the server did not become healthy:\n{self.output()[-4000:]}")

    def output(self) -> str:
        """What the server printed so far."""
        try:
            with open(self._log.name, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def shutdown(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s). Idempotent."""
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is None:
            return
        self.pid = None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()

    def cache_prefix(self, prefix: str) -> None:
        """Fill the server's cache with `prefix`."""
        self.endpoint.cache_prefix(prefix)

    def get_tokenizer(self) -> Any:
        """The served model's tokenizer (loaded locally from the model path)."""
        from sglite.runtime.model.loader import load_tokenizer

        info = self.endpoint.model_info
        return load_tokenizer(info.get("tokenizer_path") or info["model_path"], info["model_path"])

    def generate(
        self,
        prompt: str | list[str],
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
    ) -> str:
        """One `/generate` call; returns the JSON answer as a string (as SGLang's Runtime does)."""
        payload = {
            "text": prompt,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
        }
        payload = {k: v for k, v in payload.items() if v is not None}
        return json.dumps(self.endpoint._request(payload))

    async def async_generate(
        self, prompt: str, sampling_params: dict[str, Any] | None = None
    ) -> AsyncIterator[str]:
        """Stream one prompt's new text chunk by chunk."""
        import httpx

        payload = {"text": prompt, "sampling_params": sampling_params or {}, "stream": True}
        pos = 0
        async with httpx.AsyncClient(timeout=None) as client:
            async with client.stream(
                "POST", self.generate_url, json=payload, headers=self.endpoint._headers()
            ) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise RuntimeError(str(event["error"]))
                    chunk = event["text"][pos:]
                    pos += len(chunk)
                    if chunk:
                        yield chunk

    add_request = async_generate

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
