"""Resident memory and ready time of `sglite serve` beside llama.cpp's `llama-server`.

For each GGUF, both servers get the same KV capacity (sglite `--max-total-tokens 16384`,
llama-server `-c 16384 -np 4`) and are started, in alternating order, a FIRST and a SECOND time:

- ready time: wall time from the process start to the first HTTP 200 from `/health` (sglite
  listens only once loaded and warmed up; llama-server answers 503 while loading);
- FIRST start: sglite with a fresh, empty `SGLITE_CACHE_DIR` (tokenizer conversion, GGUF
  index) and `SGLITE_KERNEL_CACHE` (the C kernels, rebuilt with gcc; `--warm-kernels` keeps
  the user's instead); SECOND start: the same directories again. llama-server keeps no on-disk
  cache, so its two starts differ only by chance. The OS page cache holds the GGUF in both (the
  file is read once before the first timed start), for both servers;
- resident memory: after one short completion (16 new tokens) and 2 s idle, the RSS summed over
  the server and all its descendants (sglite's scheduler is a child process), and the PSS sum
  (`smaps_rollup`): a file page mapped by two processes counts once in PSS, twice in RSS.

A server whose tree's RSS passes `--max-rss-gb` (or that leaves less than `--min-available-gb`
of the machine's memory) is killed and reported as "exceeded"; one that exits is "crashed (exit
code -11 SIGSEGV; log PATH)", in the table and the list under it; a missing llama-server is
"missing". No peer is dropped silently. llama-server is the binary `find_llama_server` picks
(`--llama-server`, else the build script's best configuration for the host, else PATH), its
build named in the preamble.

    python -m benchmarks.bench_footprint --model /path/a.gguf [--model NAME ...] [--synthetic-7b]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import (
    add_json_option,
    add_llama_server_option,
    exit_text,
    free_port,
    get_json,
    git_revision,
    healthy,
    markdown_table,
    post_json,
)
from benchmarks.host import cpu_line
from benchmarks.runners.llama_cpp import find_llama_server, llama_build_line, llama_version

KV_TOKENS = 16384
LLAMA_SLOTS = 4
PROMPT = "The capital of France is"
NEW_TOKENS = 16
IDLE_S = 2.0
GUARD_PERIOD_S = 0.1
GB = 1e9
SGLITE, LLAMA = "sglite", "llama.cpp"


# ---------------------------------------------------------------------------- process memory
@dataclass
class TreeMemory:
    """Memory summed over a process and its descendants (bytes)."""

    rss: int
    pss: int
    processes: int
    anon: int = 0  # RssAnon: private memory, not file pages (the mapped GGUF) or shmem


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's `children` file); [] once it is gone."""
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return []
    kids: list[int] = []
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            continue
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (breadth first)."""
    tree, queue = [], [pid]
    while queue:
        p = queue.pop(0)
        if p not in tree:
            tree.append(p)
            queue += children(p)
    return tree


def _kb_field(path: str, name: str) -> int | None:
    """The `name:   N kB` line of a /proc file, in bytes (None if the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def tree_memory(pid: int, pss: bool = True) -> TreeMemory:
    """RSS (`VmRSS`) and PSS (`smaps_rollup`; 0 unless `pss`) summed over `pid`'s process tree.

    PSS walks every mapping of the process (costly on a big one); RSS is a counter.
    """
    rss = pss_sum = anon = n = 0
    for p in process_tree(pid):
        r = _kb_field(f"/proc/{p}/status", "VmRSS")
        if r is None:  # exited meanwhile, or a kernel thread without memory
            continue
        rss += r
        anon += _kb_field(f"/proc/{p}/status", "RssAnon") or 0
        if pss:
            pss_sum += _kb_field(f"/proc/{p}/smaps_rollup", "Pss") or 0
        n += 1
    return TreeMemory(rss, pss_sum, n, anon)


def mem_available() -> int:
    """The machine's MemAvailable in bytes."""
    return _kb_field("/proc/meminfo", "MemAvailable") or 0


class RssGuard(threading.Thread):
    """Samples a process tree's RSS; kills the tree when it passes the limits. Keeps the peak."""

    def __init__(self, pid: int, max_rss: float, min_available: float) -> None:
        super().__init__(daemon=True, name=f"rss-guard-{pid}")
        self.pid, self.max_rss, self.min_available = pid, max_rss, min_available
        self.peak = 0
        self.exceeded = ""
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(GUARD_PERIOD_S):
            rss = tree_memory(self.pid, pss=False).rss
            self.peak = max(self.peak, rss)
            free = mem_available()
            if rss > self.max_rss or free < self.min_available:
                self.exceeded = (
                    f"RSS {rss / GB:.1f} GB > {self.max_rss / GB:.0f} GB"
                    if rss > self.max_rss
                    else f"MemAvailable {free / GB:.1f} GB < {self.min_available / GB:.1f} GB"
                )
                kill_tree(self.pid, signal.SIGKILL)
                return

    def stop(self) -> None:
        """End the sampling."""
        self._done.set()
        self.join()


def kill_tree(pid: int, sig: int) -> None:
    """Send `sig` to `pid` and each of its descendants (by id)."""
    for p in reversed(process_tree(pid)):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------- one server start
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


# ---------------------------------------------------------------------------- rounds
def warm_page_cache(path: str) -> None:
    """Read the file once, so both servers find it in the OS page cache."""
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def first_and_second(
    make: Callable[[Path], ServerCommand], model: str, args: argparse.Namespace
) -> list[Start]:
    """A FIRST and a SECOND start of one server (a second only when the first was ok)."""
    with tempfile.TemporaryDirectory(prefix="footprint-cache-") as cache:
        first = measure_start(make(Path(cache)), model, "first", args)
        if first.status != "ok":
            return [first]
        return [first, measure_start(make(Path(cache)), model, "second", args)]


def bench_model(model: str, llama: str | None, args: argparse.Namespace) -> list[Start]:
    """Every round of both servers on one model, alternating which goes first."""
    warm_page_cache(model)
    name = os.path.basename(model)

    def make_sglite(cache: Path) -> ServerCommand:
        return sglite_command(model, free_port(), cache, args.warm_kernels)

    def make_llama(cache: Path) -> ServerCommand:
        return llama_command(llama or "", model, free_port(), args.threads)

    starts: list[Start] = []
    for r in range(args.rounds):
        order = [(SGLITE, make_sglite), (LLAMA, make_llama)]
        for server, make in order if r % 2 == 0 else order[::-1]:
            if server == LLAMA and llama is None:
                if r == 0:
                    status = "skipped" if args.skip_llama_cpp else "missing"
                    starts.append(Start(name, LLAMA, "first", status, detail=args.llama_why))
                continue
            print(f"  round {r + 1}: {server} on {name} ...", flush=True)
            for s in first_and_second(make, name, args):
                starts.append(s)
                print(f"    {s.kind}: {describe(s)}", flush=True)
    return starts


def describe(s: Start) -> str:
    """One start in a line."""
    if s.status != "ok":
        return f"{s.status} ({s.detail})"
    return (
        f"ready {s.ready_s:.2f} s, RSS {s.rss / GB:.2f} GB (anon {s.anon / GB:.2f}), "
        f"PSS {s.pss / GB:.2f} GB, "
        f"peak {s.peak_rss / GB:.2f} GB, {s.processes} processes"
        + (f"; {s.detail}" if s.detail else "")
    )


# ---------------------------------------------------------------------------- the table
@dataclass
class Row:
    """One model and server: medians over rounds (memory from the SECOND starts, else FIRST);
    the peak is the highest sampled over all its starts."""

    model: str
    server: str
    status: str
    first_ready_s: float | None
    second_ready_s: float | None
    rss_gb: float | None
    pss_gb: float | None
    anon_gb: float | None
    peak_rss_gb: float | None
    starts: int


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(starts: list[Start]) -> list[Row]:
    """Rows per (model, server), in the order first seen."""
    rows = []
    keys = list(dict.fromkeys((s.model, s.server) for s in starts))
    for model, server in keys:
        mine = [s for s in starts if (s.model, s.server) == (model, server)]
        ok = [s for s in mine if s.status == "ok"]
        # A crash names its exit code and log in the table too, not only in the list below it.
        bad = sorted(
            {s.status if s.status != "crashed" else f"crashed ({s.detail})" for s in mine} - {"ok"}
        )
        status = "ok" if not bad else ("ok, " if ok else "") + "/".join(bad)
        mem = [s for s in ok if s.kind == "second"] or ok
        rows.append(
            Row(
                model,
                server,
                status,
                _median([s.ready_s for s in ok if s.kind == "first"]),
                _median([s.ready_s for s in ok if s.kind == "second"]),
                _median([s.rss / GB for s in mem]),
                _median([s.pss / GB for s in mem]),
                _median([s.anon / GB for s in mem]),
                max([s.peak_rss / GB for s in mine if s.peak_rss], default=None),
                len(mine),
            )
        )
    return rows


def _fmt(v: float | None, spec: str = "{:.2f}") -> str:
    return "-" if v is None else spec.format(v)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def table(rows: list[Row]) -> str:
    """Markdown table; the ratio columns sit on sglite's row (sglite / llama.cpp)."""
    heads = [
        "model", "server", "status", "first-start ready (s)", "second-start ready (s)",
        "RSS (GB)", "PSS (GB)", "anon RSS (GB)", "peak RSS (GB)", "RSS sglite/llama",
        "PSS sglite/llama",
    ]  # fmt: skip
    peers = {(r.model, r.server): r for r in rows}
    cells = []
    for r in rows:
        peer = peers.get((r.model, LLAMA)) if r.server == SGLITE else None
        rss_x = _ratio(r.rss_gb, peer.rss_gb) if peer else ""
        pss_x = _ratio(r.pss_gb, peer.pss_gb) if peer else ""
        cells.append(
            [r.model, r.server, r.status, _fmt(r.first_ready_s), _fmt(r.second_ready_s),
             _fmt(r.rss_gb), _fmt(r.pss_gb), _fmt(r.anon_gb), _fmt(r.peak_rss_gb), rss_x, pss_x]
        )  # fmt: skip
    return markdown_table(heads, cells, right=range(3, len(heads)), pad=False)


# ---------------------------------------------------------------------------- command line
def resolve_model(name: str) -> str:
    """A GGUF path, a known model name (sglite's catalog: `sglite models list`), or "default"."""
    from sglite.runtime.model.catalog import resolve_model_path

    try:
        path = resolve_model_path(None if name == "default" else name)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"--model {name!r}: {exc}") from None
    if not os.path.isfile(path):
        raise SystemExit(f"--model {name!r}: {path} is not a GGUF file (llama-server needs one)")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (see the module docstring)."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_footprint", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--model",
        action="append",
        help="GGUF file, known model name or 'default' (repeatable; default: the default model)",
    )
    ap.add_argument(
        "--synthetic-7b",
        action="store_true",
        help="also a synthetic GGUF with Qwen2.5-7B's shapes (benchmarks/"
        "synthetic_gguf.py; written once, ~5 GB)",
    )
    ap.add_argument(
        "--synthetic-dir",
        help="where the synthetic GGUF is kept "
        "(default $SGLITE_CACHE_DIR/synthetic, i.e. ~/.cache/sglite/synthetic)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="first+second starts per server")
    add_llama_server_option(ap)
    ap.add_argument("--skip-llama-cpp", action="store_true", help="measure sglite only")
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="llama-server -t (sglite uses its default: all cores)",
    )
    ap.add_argument(
        "--max-rss-gb",
        type=float,
        default=20.0,
        help="kill a server whose process tree's RSS passes this",
    )
    ap.add_argument(
        "--min-available-gb",
        type=float,
        default=1.5,
        help="kill a server when the machine's MemAvailable falls below this",
    )
    ap.add_argument(
        "--warm-kernels",
        action="store_true",
        help="first starts keep the user's compiled kernels ($SGLITE_KERNEL_CACHE)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for ready")
    add_json_option(ap, "every start and the table's rows")
    return ap.parse_args(argv)


def models_of(args: argparse.Namespace) -> list[str]:
    """The GGUF files to measure, the synthetic 7B last (written first if missing)."""
    models = [resolve_model(m) for m in (args.model or ([] if args.synthetic_7b else ["default"]))]
    if args.synthetic_7b:
        from benchmarks.synthetic_gguf import synthetic_7b

        models.append(str(synthetic_7b(args.synthetic_dir)))
    return models


def preamble(args: argparse.Namespace, llama: str | None) -> list[str]:
    """What was measured and how, printed above the table."""
    cleared = "SGLITE_CACHE_DIR (tokenizer conversion, GGUF index)"
    if not args.warm_kernels:
        cleared += " and SGLITE_KERNEL_CACHE (C kernels compiled with gcc)"
    peer = (
        f"{llama} ({llama_version(llama)}; {llama_build_line(llama)})"
        if llama
        else f"missing: {args.llama_why}"
    )
    return [
        f"host: {cpu_line()}; sglite {git_revision()}",
        f"llama-server: {peer}",
        f"KV capacity {KV_TOKENS} tokens: sglite --max-total-tokens {KV_TOKENS}; llama-server "
        f"-c {KV_TOKENS} -np {LLAMA_SLOTS} -t {args.threads}",
        f"first start: sglite with fresh, empty {cleared}; llama-server has no on-disk cache. "
        "second start: the same cache directories again. OS page cache warm (the GGUF read "
        "once before) for both servers in both starts; Python modules from their compiled "
        "bytecode in both.",
        f"ready: process start to first 200 from /health. memory: after one {NEW_TOKENS}-token "
        f"completion and {IDLE_S:.0f} s idle, summed over the server's process tree, medians "
        "of the second starts; peak RSS: the highest sampled (every 0.1 s, RSS only) over all "
        "starts; anon RSS: RssAnon (RSS less file pages such as the mapped GGUF, and shmem).",
    ]


def main(argv: list[str] | None = None) -> int:
    """Run every model, print the table, save JSON."""
    args = parse_args(argv)
    llama, args.llama_why = (
        (None, "--skip-llama-cpp")
        if args.skip_llama_cpp
        else (find_llama_server(args.llama_server))
    )
    models = models_of(args)
    lines = preamble(args, llama)
    print("\n".join(lines), flush=True)
    starts: list[Start] = []
    for model in models:
        print(f"{os.path.basename(model)}:", flush=True)
        starts += bench_model(model, llama, args)
    rows = summarize(starts)
    print("\n" + "\n".join(lines) + "\n\n" + table(rows))
    for s in starts:
        if s.status != "ok":
            print(f"- {s.model} {s.server} {s.kind} start: {s.status}: {s.detail}")
    if args.json:
        out = {
            "preamble": lines,
            "command": " ".join(sys.argv),
            "rows": [asdict(r) for r in rows],
            "starts": [asdict(s) for s in starts],
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
