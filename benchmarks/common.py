"""What the benchmark scripts share: command-line options, servers started and stopped, HTTP
calls, Markdown tables, prompts of an exact token length, and the command and revision of a run.

llama.cpp's discovery and start-up live with its runner (`runners/llama_cpp.py`); the host line
every benchmark prints is `host.py`'s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import IO

LOCALHOST = "127.0.0.1"


# ---------------------------------------------------------------------------- command line
def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose help is the script's docstring, its line breaks kept."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)


def add_server_options(p: argparse.ArgumentParser) -> None:
    """Where the server under test is, or `--launch` to start an sglite server for the run."""
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (no /v1)")
    p.add_argument("--launch", action="store_true", help="start an sglite server for the run")
    p.add_argument("--server-args", default="", help="extra flags for --launch")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))


def add_llama_server_option(p: argparse.ArgumentParser) -> None:
    """`--llama-server PATH` (`runners.llama_cpp.find_llama_server` looks when it is absent)."""
    p.add_argument(
        "--llama-server",
        default=None,
        help="llama-server binary (default: on PATH, then the one "
        "benchmarks/build_llama_cpp.sh builds)",
    )


def add_json_option(p: argparse.ArgumentParser, what: str = "the rows") -> None:
    """`--json PATH`: the results also written as JSON."""
    p.add_argument("--json", default=None, help=f"also write {what} to this JSON file")


def command_line(module: str) -> str:
    """The command that started this run (`python -m module ...`), to paste beside its results."""
    return shlex.join(["python", "-m", module, *sys.argv[1:]])


def git_revision() -> str:
    """Short commit hash, with '+dirty' when the tree has changes; '?' outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    except OSError:
        return "?"
    return (rev or "?") + ("+dirty" if dirty else "")


# ---------------------------------------------------------------------------- processes
def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def healthy(base_url: str) -> bool:
    """Whether `/health` answers 200 now (not while refused, loading (503) or reset)."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


# ---------------------------------------------------------------------------- peers
def exit_text(code: int) -> str:
    """A process's exit code as a table reads it: "-11 SIGSEGV" for a signal, else "3"."""
    if code < 0:
        try:
            return f"{code} {signal.Signals(-code).name}"
        except ValueError:
            pass
    return str(code)


@dataclass
class PeerStatus:
    """How a peer fared: a process a benchmark runs beside (or as) the system under test, such as
    llama.cpp's llama-server or a launched sglite server. `state` is "ok", "crashed" (it exited:
    `exit_code`, `log`, `when`: "at start-up" or "mid-run"), "failed" (it runs, but calls to it
    failed: `reason`), "skipped" (not run: `reason`) or "fallback" (measured in another
    configuration than asked: `reason` says which and why). `build` names the binary's build
    (for llama.cpp, `runners.llama_cpp.llama_build_line`). Every benchmark shows it with
    `cell()` in its table and `line()` in its summary, so no peer is left blank or dropped."""

    name: str
    state: str = "ok"
    exit_code: int | None = None
    log: str | None = None
    when: str = ""
    reason: str = ""
    build: str = ""

    @property
    def ok(self) -> bool:
        """Whether the peer ran as asked (its figures stand)."""
        return self.state == "ok"

    def cell(self) -> str:
        """The table cell: "ok", "crashed at start-up (exit -11 SIGSEGV, log: PATH)",
        "failed (why)", "skipped (why)", "fallback (what)"."""
        if self.state == "crashed":
            code = "?" if self.exit_code is None else exit_text(self.exit_code)
            where = f", log: {self.log}" if self.log else ""
            when = f" {self.when}" if self.when else ""
            return f"crashed{when} (exit {code}{where})"
        return f"{self.state} ({self.reason})" if self.reason else self.state

    def line(self) -> str:
        """The summary line: "name [build]: cell"."""
        build = f" [{self.build}]" if self.build else ""
        return f"{self.name}{build}: {self.cell()}"


class PeerCrashed(RuntimeError):
    """A peer's process exited while the benchmark needed it; `status` says how."""

    def __init__(self, status: PeerStatus) -> None:
        super().__init__(status.line())
        self.status = status

    def __str__(self) -> str:  # the status may gain its build after the raise
        return self.status.line()


def peer_failure(
    name: str, proc: subprocess.Popen | None, log: str | None, exc: BaseException
) -> PeerStatus:
    """The status of a peer after a call to it raised `exc`: "crashed" mid-run when its process
    has exited (waiting briefly: a dying process closes its socket first), else "failed"."""
    if isinstance(exc, PeerCrashed):
        return exc.status
    if proc is not None:
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            pass
        if proc.returncode is not None:
            return PeerStatus(name, "crashed", proc.returncode, log, "mid-run")
    return PeerStatus(name, "failed", reason=f"{type(exc).__name__}: {str(exc)[:200]}")


def process_status(name: str, proc: subprocess.Popen, log: str | None) -> PeerStatus:
    """A peer that should still be running: "ok" while it is, else "crashed" mid-run."""
    code = proc.poll()
    if code is None:
        return PeerStatus(name)
    return PeerStatus(name, "crashed", code, log, "mid-run")


def wait_healthy(
    proc: subprocess.Popen,
    base_url: str,
    timeout: float = 600,
    name: str = "the server",
    log: str | None = None,
) -> None:
    """Until `base_url` is healthy; raises `PeerCrashed` if `proc` exits first (its exit code and
    log) or TimeoutError when time runs out (the process is then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerCrashed(PeerStatus(name, "crashed", proc.returncode, log, "at start-up"))
        if healthy(base_url):
            return
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{name} did not become healthy")


def wait_settled(server_info: Callable[[], dict], timeout: float = 120) -> None:
    """Until a started sglite has moved its weights into 2 MB pages (`weights_huge_pages`, done
    between steps and while idle after a start), so that measurements see its steady state:
    `server_info` is an Engine's `get_server_info` or a GET of a server's `/get_server_info`."""
    deadline = time.monotonic() + timeout
    while (server_info().get("weights_huge_pages") or {}).get("pending"):
        if time.monotonic() > deadline:
            raise TimeoutError("the weights' move into 2 MB pages did not finish")
        time.sleep(0.1)


def start_module(
    args: list[str], base_url: str, timeout: float = 600, stdout: IO | int | None = None
) -> subprocess.Popen:
    """Run `python -m <args>` and wait until `base_url` is healthy."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=stdout)
    wait_healthy(proc, base_url, timeout, name=args[0])
    return proc


def launch_server(flags: list[str], port: int, stdout: IO | int | None = None) -> subprocess.Popen:
    """Start `python -m sglite.launch_server --port port <flags>` and wait until it is healthy
    and settled (`wait_settled`)."""
    args = ["sglite.launch_server", "--port", str(port), *flags]
    base_url = f"http://{LOCALHOST}:{port}"
    proc = start_module(args, base_url, stdout=stdout)
    wait_settled(lambda: _server_info(base_url))
    return proc


def _server_info(base_url: str) -> dict:
    """A server's `/get_server_info`, empty where it refuses (an API key the caller holds)."""
    try:
        return get_json(f"{base_url}/get_server_info")
    except urllib.error.HTTPError:
        return {}


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL if it lingers past `timeout` seconds; waits either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# ---------------------------------------------------------------------------- HTTP
def post_json(url: str, body: dict, timeout: float = 3600) -> dict:
    """POST `body` as JSON; the answer's JSON (raises on an HTTP error)."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_json(url: str, headers: dict[str, str] | None = None, timeout: float = 60) -> dict:
    """GET `url`; the answer's JSON."""
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def discover_model(base_url: str, headers: dict[str, str] | None = None) -> str | None:
    """The first model id of `base_url`/v1/models, if the endpoint has one."""
    try:
        return get_json(base_url + "/v1/models", headers, timeout=30)["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
        return None


def flush_cache(
    base_url: str,
    headers: dict[str, str] | None = None,
    retry_s: float = 0,
    check: bool = False,
) -> bool:
    """POST /flush_cache (sglite and SGLang servers): whether it succeeded. A server refuses while
    requests still run, so with `retry_s` it is asked again for that long. Other endpoints have
    no such route, so a failure is no error unless `check` is set."""
    deadline = time.monotonic() + retry_s
    url = base_url + "/flush_cache"
    while True:
        try:
            req = urllib.request.Request(url, headers=headers or {}, method="POST")
            with urllib.request.urlopen(req, timeout=60):
                return True
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() >= deadline:
                if check:
                    raise RuntimeError(f"{url}: {exc}") from exc
                return False
        time.sleep(0.5)


# ---------------------------------------------------------------------------- reports
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def markdown_table(
    heads: Sequence[str],
    rows: Sequence[Sequence[str]],
    right: Collection[int] = (),
    pad: bool = True,
) -> str:
    """A Markdown table; columns in `right` right-aligned; with `pad`, cells padded to their
    column's width so the table also reads as plain text."""
    if not pad:
        rule = "|" + "|".join("---:" if i in right else "---" for i in range(len(heads))) + "|"
        lines = ["| " + " | ".join(heads) + " |", rule]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in right else "-" * (w + 2) for i, w in enumerate(widths)
        )
        + "|"
    )

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(heads), rule, *(line(row) for row in rows)])


# ---------------------------------------------------------------------------- prompts
WORDS = (
    "the of and a to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part river mountain city"
).split()


class PromptMaker:
    """Builds prompts of an exact token length with a tokenizer (the default model's, unless
    given), from a seeded generator."""

    def __init__(self, tokenizer_path: str | None, seed: int) -> None:
        from sglite.runtime.model.loader import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        self.rng = random.Random(seed)

    def text(self, n_tokens: int) -> str:
        """Random words cut to n_tokens tokens."""
        words = " ".join(self.rng.choice(WORDS) for _ in range(n_tokens + 8))
        ids = self.tokenizer.encode(words)[:n_tokens]
        return self.tokenizer.decode(ids)

    def count(self, text: str) -> int:
        """Token count of text."""
        return len(self.tokenizer.encode(text))
