"""llama.cpp's `llama-server` as an sglite backend, driven through its native HTTP API.

The server runs on the same GGUF file, with `-t` = the same thread count, `-np 16` parallel
slots, `-c` = 16 x 2048 tokens and continuous batching (its default); every request sets
`cache_prompt: true`, so each slot reuses the longest prefix it already holds. The program logic
stays in Python (sglite's interpreter), one `/completion` call per `gen`:

- constraints: `json_schema` as is; a `regex` as an equivalent GBNF `grammar` (`gbnf.py`), or
  unconstrained (counted, reported) when the converter cannot express it;
- `select`: one call per choice, in turn (so the later ones find the prefix in the first one's
  slot), the choice forced by a literal grammar with `n_probs: 1`; the returned logprobs of the
  forced tokens come from the model's raw distribution (not the grammar's), so each choice gets
  the mean logprob of its own tokens, like sglite's default;
- no pre-caching calls (the interpreter's prefill-only requests are no-ops here, as for any
  backend without `cache_prefix`).

The hit rate comes from each answer's `timings` (`cache_n` of `cache_n + prompt_n` prompt
tokens). The server is restarted for every workload, so each starts on a cold cache.
Skipped with a message when no binary is found (`--llama-server PATH`, else the one
`benchmarks/build_llama_cpp.sh` built, else `llama-server` on PATH).

Every benchmark with llama.cpp as a peer finds it here (`find_llama_server`: the build script's
binary before one on PATH, since the script installs the best configuration that runs on this
host and a packaged native build can crash, e.g. in the AMX path), names its build with
`llama_build_line` (the script's `BUILD` record) beside its figures, and reports a server that
exits as a `benchmarks.common.PeerStatus` ("crashed at start-up (exit -11 SIGSEGV, log: PATH)")
in its table and summary rather than an empty column.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from typing import IO, Any

from benchmarks.common import (
    LOCALHOST,
    PeerCrashed,
    PeerStatus,
    free_port,
    peer_failure,
    post_json,
    stop_process,
    wait_healthy,
)
from benchmarks.ideal_cache import CallLog
from benchmarks.runners.common import ResultRow, System, default_threads
from benchmarks.runners.gbnf import literal_gbnf, regex_to_gbnf
from sglite.lang.backend.base import BaseBackend, apply_dtype, mean_logprob
from sglite.lang.chat_template import from_tokenizer
from sglite.lang.choices import ChoicesDecision, token_length_normalized
from sglite.lang.sampling_params import SglSamplingParams

SLOTS = 16
CTX_PER_SLOT = 2048


def built_llama_server() -> str:
    """Where `benchmarks/build_llama_cpp.sh` installs llama-server by default."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "sglite", "llama.cpp", "bin", "llama-server")


def find_llama_server(path: str | None = None) -> tuple[str | None, str]:
    """(binary or None, why): `path`, else the build script's (its best configuration that runs
    here), else `llama-server` on PATH."""
    if path:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path, "given"
        return None, f"--llama-server {path!r} is not an executable file"
    built = built_llama_server()
    if os.access(built, os.X_OK):
        return built, "built by benchmarks/build_llama_cpp.sh"
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path, "on PATH"
    return None, (
        "no llama-server: give --llama-server PATH, run `bash benchmarks/build_llama_cpp.sh`, "
        "or put it on PATH"
    )


def llama_binaries(path: str | None = None) -> tuple[str | None, str | None]:
    """(llama-bench, llama-server): the server `find_llama_server(path)` picks and the
    llama-bench beside it."""
    server, _ = find_llama_server(path)
    if server is None:
        return None, None
    bench = os.path.join(os.path.dirname(server), "llama-bench")
    return (bench if os.access(bench, os.X_OK) else None), server


def start_llama_server(
    binary: str,
    model: str,
    threads: int,
    slots: int,
    ctx_per_slot: int,
    log: IO,
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """llama-server on `model` with `slots` parallel slots of `ctx_per_slot` tokens each, CPU
    only: (process, base url) once healthy (it answers 503 while loading)."""
    port = free_port()
    cmd = [
        binary, "-m", model, "--host", LOCALHOST, "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", str(slots),
        "-c", str(slots * ctx_per_slot), "-ngl", "0", *extra,
    ]  # fmt: skip
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://{LOCALHOST}:{port}"
    try:
        wait_healthy(proc, base, timeout=300, name="llama-server", log=log.name)
    except PeerCrashed as exc:
        exc.status.build = llama_build_line(binary)
        raise
    return proc, base


def llama_status(binary: str, state: str = "ok", **kw) -> PeerStatus:
    """A llama-server peer's status, its build named."""
    return PeerStatus("llama-server", state, build=llama_build_line(binary), **kw)


def llama_failure(
    binary: str, proc: subprocess.Popen | None, log: str | None, exc: BaseException
) -> PeerStatus:
    """`peer_failure` of a llama-server (crashed mid-run, or a failed call), its build named."""
    status = peer_failure("llama-server", proc, log, exc)
    status.build = status.build or llama_build_line(binary)
    return status


def llama_build(binary: str) -> str:
    """Which configuration `benchmarks/build_llama_cpp.sh` built (its `BUILD` file beside the
    binary): "native build", "build without AMX" (the native one crashed here), else "build"."""
    try:
        with open(os.path.join(os.path.dirname(binary), "BUILD")) as f:
            config = f.read()
    except OSError:
        return "build"
    return "build without AMX" if "crashed" in config else "native build"


def llama_build_line(binary: str) -> str:
    """The build for tables and summaries: `llama_build`'s name and the script's record, e.g.
    "build without AMX: native crashed; -DGGML_NATIVE=OFF ..."; a binary without the record
    (on PATH, or given) says its configuration is unknown, with its path."""
    try:
        with open(os.path.join(os.path.dirname(binary), "BUILD")) as f:
            record = f.read().strip()
    except OSError:
        return f"not built by benchmarks/build_llama_cpp.sh, configuration unknown: {binary}"
    return f"{llama_build(binary)}: {record}"


def llama_version(binary: str) -> str:
    """`llama-server --version`'s version line ('?' when it cannot be read)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("version"):
            return line.split(":", 1)[-1].strip()
    return "?"


class LlamaServerBackend(BaseBackend):
    """sglite backend on llama-server's `/completion` (see the module docstring)."""

    def __init__(self, base_url: str, tokenizer: Any, model_path: str) -> None:
        super().__init__()
        self.url = base_url + "/completion"
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.chat_template = from_tokenizer(tokenizer, model_path)
        self.log = CallLog()
        self.cached = self.queried = 0
        self.unconstrained_calls = 0
        self._lock = threading.Lock()

    def get_model_name(self) -> str:
        return self.model_path

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        body = {"cache_prompt": True, "stream": False, "repeat_penalty": 1.0, **body}
        out = post_json(self.url, body)
        timings = out.get("timings") or {}
        cached = timings.get("cache_n", out.get("tokens_cached", 0)) or 0
        fresh = timings.get("prompt_n", 0) or 0
        with self._lock:
            self.cached += cached
            self.queried += cached + fresh
        return out

    # ------------------------------------------------------------------ language hooks
    def generate(
        self, s: Any, sampling_params: SglSamplingParams
    ) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        p = sampling_params.clone()
        apply_dtype(p)
        body: dict[str, Any] = {
            "prompt": s.text_,
            "n_predict": p.max_new_tokens,
            "stop": p.stop_list(),
            "ignore_eos": bool(p.ignore_eos),
        }
        if p.temperature and p.temperature > 1e-5:
            body.update(temperature=p.temperature, top_p=p.top_p, min_p=p.min_p or 0.0)
            body["top_k"] = p.top_k if p.top_k and p.top_k > 0 else 0
        else:
            body["temperature"] = 0.0  # greedy
        if p.json_schema is not None:
            schema = p.json_schema
            body["json_schema"] = json.loads(schema) if isinstance(schema, str) else schema
        elif p.regex is not None:
            grammar = regex_to_gbnf(p.regex)
            if grammar is None:
                self.unconstrained_calls += 1
            else:
                body["grammar"] = grammar
        texts, metas = [], []
        for _ in range(p.n or 1):
            call = self.log.start(s.text_)
            out = self._complete(body)
            call.output = out.get("content", "")
            texts.append(call.output)
            metas.append(
                {
                    "prompt_tokens": out.get("tokens_evaluated", 0),
                    "completion_tokens": out.get("tokens_predicted", 0),
                    "cached_tokens": (out.get("timings") or {}).get("cache_n", 0),
                    "finish_reason": out.get("stop_type", ""),
                }
            )
        if (p.n or 1) > 1:
            return texts, metas
        return texts[0], metas[0]

    def select(
        self, s: Any, choices: list[str], temperature: float, choices_method: Any = None
    ) -> ChoicesDecision:
        method = choices_method or token_length_normalized
        if method.requires_unconditional_logprobs:
            raise NotImplementedError("unconditional select scoring is not run on llama-server")
        # One choice after the other: the first leaves the prefix in its slot, and llama-server
        # gives each next call the idle slot whose prompt is most similar, so the rest hit it.
        # (Sent at once, the choices land on different empty slots and all miss.)
        entries = [self._score(s.text_, c) for c in choices]
        means = [mean_logprob(ent) for ent in entries]
        return method(
            choices=choices,
            normalized_prompt_logprobs=means,
            input_token_logprobs=entries,
            output_token_logprobs=[[] for _ in choices],
        )

    def _score(self, prefix: str, choice: str) -> list[list[Any]]:
        """The choice's tokens after `prefix` as [logprob, id, text], forced by a grammar."""
        self.log.add(prefix, choice, generated=False)
        out = self._complete(
            {
                "prompt": prefix,
                "n_predict": len(self.tokenizer.encode(choice)) + 4,
                "temperature": 0.0,
                "grammar": literal_gbnf(choice),
                "n_probs": 1,
            }
        )
        entries, text = [], ""
        for item in out.get("completion_probabilities") or []:
            if len(text) >= len(choice):
                break  # the end-of-sequence token after the forced text is not the choice's
            token = item.get("token", "")
            text += token
            entries.append([float(item.get("logprob", float("-inf"))), item.get("id"), token])
        return entries


class LlamaServerSystem(System):
    """llama.cpp's llama-server, restarted (cold) for every workload."""

    name = "llama.cpp"

    def __init__(self, binary: str, threads: int | None = None) -> None:
        super().__init__()
        self.binary = binary
        self.threads = threads or default_threads()
        self.version = llama_version(binary)
        self.build = llama_build_line(binary)
        self.description = (
            f"llama-server {self.version} ({self.build}): -t {self.threads} -np {SLOTS} "
            f"-c {SLOTS * CTX_PER_SLOT}, cache_prompt"
        )
        self.status: PeerStatus | None = None  # set once it crashed (then its log is kept)
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(
            "w", prefix="llama-server-", suffix=".log", delete=False
        )

    def start(self) -> None:
        from sglite.runtime.model.loader import default_model_path, load_tokenizer

        self.model_path = default_model_path()
        self.tokenizer = load_tokenizer(self.model_path)
        self._restart()

    def _restart(self) -> None:
        self._kill()
        try:
            self.proc, base = start_llama_server(
                self.binary, self.model_path, self.threads, SLOTS, CTX_PER_SLOT, self._log
            )
        except PeerCrashed as exc:
            self.status = exc.status
            raise
        self.backend = LlamaServerBackend(base, self.tokenizer, self.model_path)

    def _kill(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=30)
            self.proc = None

    def stop(self) -> None:
        self._kill()
        self.backend = None
        # The server's log is kept only when it crashed (its status names it).
        self._log.close()
        if self.status is None:
            try:
                os.unlink(self._log.name)
            except OSError:
                pass

    def flush(self) -> None:
        self._restart()  # the only way to empty every slot and the server's RAM prompt cache

    def counters(self) -> tuple[int, int]:
        return self.backend.cached, self.backend.queried

    def instrument(self, log: CallLog) -> None:
        self.backend.log = log

    def _checked(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)`, raising `PeerCrashed` when the server exited at a restart or during the
        call (programs that then fail would otherwise read as slow, wrong answers)."""
        try:
            out = fn(*args)
        except PeerCrashed:
            raise
        except Exception as exc:
            status = llama_failure(self.binary, self.proc, self._log.name, exc)
            if status.state == "crashed":
                self.status = status
                raise PeerCrashed(status) from exc
            raise
        if self.proc is not None and getattr(out, "failed", 0):
            # Programs record their errors instead of raising: a crash shows as failed
            # programs. A dying server closes its socket before it exits: wait for the exit.
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None and self.proc.poll() is not None:
            self.status = llama_status(
                self.binary, "crashed", exit_code=self.proc.returncode, log=self._log.name,
                when="mid-run",
            )  # fmt: skip
            raise PeerCrashed(self.status)
        return out

    def warm_up(self) -> None:
        self._checked(super().warm_up)

    def run(self, workload: Any, num_requests: int, seed: int = 0) -> ResultRow:
        """One workload; raises `PeerCrashed` when the server exits (see `_checked`)."""
        row = self._checked(super().run, workload, num_requests, seed)
        if self.backend.unconstrained_calls:
            self.notes.append(
                f"{workload.name}: {self.backend.unconstrained_calls} regex generations ran "
                "unconstrained (not expressible as GBNF here)"
            )
        return row
