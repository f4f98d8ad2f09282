"""One timed start of a server for bench_footprint: the `sglite serve` and `llama-server`
command lines (same KV capacity), waiting for `/health`, the one short completion, reading the
tree's memory after it, and stopping the server and everything it started."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import exit_text, get_json, healthy, post_json
from benchmarks.footprint_memory import GB, RssGuard, process_tree, tree_memory

KV_TOKENS = 16384
LLAMA_SLOTS = 4
PROMPT = "The capital of France is"
NEW_TOKENS = 16
IDLE_S = 2.0
SGLITE, LLAMA = "sglite", "llama.cpp"


@dataclass
class ServerCommand:
    """How to start one server and ask it for a short completion."""

    server: str  # SGLITE or LLAMA
    cmd: list[str]
    port: int
    route: str  # the completion route
    body: dict
    env: dict[str, str] = field(default_factory=dict)  # added to the environment


@dataclass
class Start:
    """One timed start of a server (bytes, seconds)."""

    model: str
    server: str
    kind: str  # "first" or "second"
    status: str  # ok, crashed, exceeded, timeout, request failed, missing, skipped
    ready_s: float | None = None
    rss: int | None = None
    pss: int | None = None
    anon: int | None = None
    peak_rss: int | None = None
    processes: int | None = None
    detail: str = ""


def sglite_command(model: str, port: int, cache: Path, warm_kernels: bool) -> ServerCommand:
    """`sglite serve` on `model` with its caches under `cache`."""
    # Python reads sglite's modules from compiled bytecode, as after a pip install, whatever the
    # calling shell says (an empty value disables the setting).
    env = {"SGLITE_CACHE_DIR": str(cache / "sglite"), "PYTHONDONTWRITEBYTECODE": ""}
    if not warm_kernels:
        env["SGLITE_KERNEL_CACHE"] = str(cache / "kernels")
    cmd = [
        sys.executable,
        "-m",
        "sglite.cli",
        "serve",
        "--model-path",
        model,
        "--max-total-tokens",
        str(KV_TOKENS),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
    return ServerCommand(SGLITE, cmd, port, "/generate", body, env)


def llama_command(binary: str, model: str, port: int, threads: int) -> ServerCommand:
    """`llama-server` on `model`, the same KV capacity as sglite's."""
    cmd = [
        binary,
        "-m",
        model,
        "-c",
        str(KV_TOKENS),
        "-np",
        str(LLAMA_SLOTS),
        "-ngl",
        "0",
        "-t",
        str(threads),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    body = {"prompt": PROMPT, "n_predict": NEW_TOKENS, "temperature": 0}
    return ServerCommand(LLAMA, cmd, port, "/completion", body)


def wait_ready(proc: subprocess.Popen, base: str, guard: RssGuard, timeout: float) -> str:
    """Poll `/health` until 200: "ok", or why not ("crashed", "exceeded", "timeout")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if guard.exceeded:
            return "exceeded"
        if proc.poll() is not None:
            return "crashed"
        if healthy(base):
            return "ok"
        time.sleep(0.05)
    return "timeout"


def _start_time(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/<pid>/stat): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server and wait; SIGKILL whatever of its tree is left after 60 s."""
    tree = [(p, _start_time(p)) for p in process_tree(proc.pid)]
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        pass
    for p, started in reversed(tree):  # children re-parented to init are still killed
        if started is not None and _start_time(p) == started:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def measure_start(sc: ServerCommand, model: str, kind: str, args: argparse.Namespace) -> Start:
    """Start `sc`, time it to ready, run one completion, idle, read memory, stop it."""
    base = f"http://127.0.0.1:{sc.port}"
    log = tempfile.NamedTemporaryFile(
        "w", prefix=f"footprint-{sc.server}-", suffix=".log", delete=False
    )
    start = Start(model, sc.server, kind, "ok")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        sc.cmd,
        env={**os.environ, **sc.env},
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    guard = RssGuard(proc.pid, args.max_rss_gb * GB, args.min_available_gb * GB)
    guard.start()
    try:
        start.status = wait_ready(proc, base, guard, args.timeout)
        if start.status == "ok":
            start.ready_s = time.perf_counter() - t0
            _complete(base, sc, start)
            if proc.poll() is not None and not guard.exceeded:
                start.status = "crashed"
        if start.status in ("ok", "request failed") and not guard.exceeded:
            time.sleep(IDLE_S)
            mem = tree_memory(proc.pid)
            start.rss, start.pss, start.processes = mem.rss, mem.pss, mem.processes
            start.anon = mem.anon
        if guard.exceeded:
            start.status, start.detail = "exceeded", guard.exceeded
    finally:  # the server is stopped whatever happened here (an error, Ctrl-C)
        try:
            guard.stop()
            start.peak_rss = guard.peak
        finally:
            stop_server(proc)
            log.close()
    if start.status == "crashed":
        start.detail = f"exit code {exit_text(proc.returncode)}; log {log.name}"
    elif start.status != "ok":
        start.detail = (start.detail + f"; log {log.name}").lstrip("; ")
    else:
        os.unlink(log.name)
    return start


def _complete(base: str, sc: ServerCommand, start: Start) -> None:
    """The one short completion; marks `start` as failed when it does not answer. For sglite,
    notes the dtype and weight quantization it resolved (`/get_server_info`)."""
    try:
        post_json(base + sc.route, sc.body, timeout=600)
        if sc.server == SGLITE:
            info = get_json(base + "/get_server_info", timeout=30)
            start.detail = f"dtype {info.get('dtype')}, quantization {info.get('quantization')}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        start.status, start.detail = "request failed", f"{type(exc).__name__}: {exc}"[:200]
