"""bench_pd's processes: the co-located server, the pinned prefill and decode servers and the PD
router, started, warmed up and flushed, and what they report (PD transfer counters, exit states,
log lines with warnings or errors).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass

import httpx

from benchmarks.common import (
    PeerStatus,
    PromptMaker,
    flush_cache,
    free_port,
    process_status,
    wait_healthy,
)
from benchmarks.pd_client import run_round
from benchmarks.pd_workload import LONG_OUTPUT_TOKENS, Arrival, chat


@dataclass
class Proc:
    """A started process, its URL and its log file."""

    name: str
    proc: subprocess.Popen
    url: str
    log: str


def spawn(name: str, cmd: list[str], port: int, log_dir: str) -> Proc:
    """Start `cmd` with its output in `log_dir/name.log`."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return Proc(name, proc, f"http://127.0.0.1:{port}", log)


def wait_all(procs: list[Proc], timeout: float = 600) -> None:
    """Until every process answers /health with 200; raises if one exits or time runs out."""
    for p in procs:
        wait_healthy(p.proc, p.url, timeout, name=p.name, log=p.log)


def server_cmd(args: argparse.Namespace, port: int, threads: int, *extra: str) -> list[str]:
    """`python -m sglite.launch_server` with the benchmark's common flags."""
    flags = ["--port", str(port), "--num-threads", str(threads), "--dtype", args.dtype]
    flags += ["--max-total-tokens", str(args.max_total_tokens), "--log-level", "warning"]
    return [sys.executable, "-m", "sglite.launch_server", *flags, *extra, *args.server_args]


def pinned(cpu: int, cmd: list[str], pin: bool) -> list[str]:
    """`cmd` under `taskset -c cpu` when pinning."""
    return ["taskset", "-c", str(cpu), *cmd] if pin else cmd


def start_all(args: argparse.Namespace, pin: bool, log_dir: str, procs: list[Proc]) -> None:
    """Start both setups' servers (appended to `procs` as they start), then the PD router."""
    ports = {name: free_port() for name in ("colo", "prefill", "decode", "bootstrap", "router")}
    prefill_extra = ["--disaggregation-mode", "prefill"]
    prefill_extra += ["--disaggregation-bootstrap-port", str(ports["bootstrap"])]
    decode_extra = ["--disaggregation-mode", "decode"]
    cmds = {
        "colo": server_cmd(args, ports["colo"], 2),
        "prefill": pinned(0, server_cmd(args, ports["prefill"], 1, *prefill_extra), pin),
        "decode": pinned(1, server_cmd(args, ports["decode"], 1, *decode_extra), pin),
    }
    for name, cmd in cmds.items():
        procs.append(spawn(name, cmd, ports[name], log_dir))
    wait_all(procs)
    router = [sys.executable, "-m", "sglite.router", "--pd-disaggregation", "--port"]
    router += [str(ports["router"]), "--prefill", procs[1].url, "--decode", procs[2].url]
    procs.append(spawn("router", router + ["--log-level", "warning"], ports["router"], log_dir))
    wait_all(procs[3:], timeout=120)


def flush(url: str) -> None:
    """Empty a server's cache; it refuses while requests still run, so it is asked for a while."""
    flush_cache(url, retry_s=60, check=True)


def warm_up(url: str, maker: PromptMaker, args: argparse.Namespace) -> None:
    """One short and one long request, then a flush: first passes of a shape run slower."""
    arrivals = [
        Arrival("short", 0.0, chat(maker, "Warm-up: " + maker.text(30)), args.short_tokens),
        Arrival("long", 0.0, chat(maker, maker.text(args.long_prompt_tokens)), LONG_OUTPUT_TOKENS),
    ]
    result = asyncio.run(run_round(url, arrivals, args))
    for t in result.timings:
        if not t.ok:
            raise RuntimeError(f"warm-up request to {url} failed: {t.error}")
    flush(url)


def pd_counters(servers: dict[str, str]) -> dict[str, int]:
    """{"prefill transfers": n, "prefill failed": n, "decode ...": ...} from `{name: url}`; warns
    when a server's KV accounting is off."""
    counts = {}
    for name, url in servers.items():
        info = httpx.get(url + "/get_server_info", timeout=60).json()
        counts[f"{name} transfers"] = int(info.get("disaggregation_transfers", 0))
        counts[f"{name} failed"] = int(info.get("disaggregation_failed_transfers", 0))
        if not info.get("kv_invariants", {}).get("ok", True):
            print(f"  !! {name}: KV invariants broken: {info['kv_invariants']}", flush=True)
    return counts


def statuses(procs: list[Proc]) -> list[PeerStatus]:
    """Each process's state now: ok while it runs, else crashed (its exit code and log)."""
    return [process_status(p.name, p.proc, p.log) for p in procs]


SETUP_PROCS = {"co-located": ("colo",), "PD": ("prefill", "decode", "router")}


def log_problems(procs: list[Proc]) -> list[str]:
    """Lines of the processes' logs that look like warnings, errors or tracebacks."""
    found = []
    for p in procs:
        with open(p.log, encoding="utf-8", errors="replace") as f:
            for line in f:
                if any(w in line.lower() for w in ("error", "warn", "traceback", "exception")):
                    found.append(f"{p.name}: {line.strip()[:300]}")
    return found
