"""bench_spec's llama.cpp peer: the llama-server configurations compared with sglite (its
n-gram draft types, or the same draft-model pair), one server per configuration restarted before
every round, and how each fared (one that crashes is dropped from the later rounds).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch

from benchmarks.common import PeerCrashed, PeerStatus, post_json
from benchmarks.runners.llama_cpp import (
    find_llama_server,
    llama_build_line,
    llama_version,
    start_llama_server,
)
from sglite.runtime.model.catalog import resolve_model_path

# llama-server's n-gram speculation: its default n-gram lookup, the same with a short lookup and
# draft (its best on these prompts), and its n-gram-mod type.
LLAMA_SPEC = {
    "ngram-simple": ("--spec-type", "ngram-simple"),
    "ngram-simple n3 m8": (
        "--spec-type", "ngram-simple",
        "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8",
    ),
    "ngram-mod": ("--spec-type", "ngram-mod"),
}  # fmt: skip


class LlamaServer:
    """One llama-server (one slot) on the default GGUF with the given speculative flags.

    Some of its draft types keep what they learned across requests (`ngram-mod`'s n-gram pool
    outlives the request), so a round that asks the same prompt again would draft the earlier
    rounds' answer: `restart` gives every round a server that has seen only its prompt, as
    sglite's runs start from a flushed cache."""

    def __init__(self, binary: str, model_path: str, threads: int, extra: tuple[str, ...]):
        self.binary, self.model_path, self.threads, self.extra = binary, model_path, threads, extra
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.restart()

    def restart(self) -> None:
        """Stop the server (if running) and start a fresh one, waiting until it answers."""
        self.close()
        self.proc, self.base = start_llama_server(
            self.binary, self.model_path, self.threads, 1, 4096, self.log, self.extra
        )

    def decode_run(self, prompt: str, tokens: int, reask: bool) -> tuple[float, int, int, list]:
        """(decode tok/s, drafted, accepted, output ids) with the prompt cached beforehand
        (with `reask`, after a full run of the same request, as `decode_run` does for sglite)."""
        body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": True}
        post_json(self.base + "/completion", body if reask else {**body, "n_predict": 1})
        out = post_json(self.base + "/completion", {**body, "return_tokens": True})
        timings = out["timings"]
        return (
            timings["predicted_per_second"],
            timings.get("draft_n", 0),
            timings.get("draft_n_accepted", 0),
            out.get("tokens", []),
        )

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@dataclass
class Peers:
    """llama.cpp's servers by configuration ("off" and the speculative ones) and how each fared
    (a configuration that crashed has a status and no server from then on)."""

    servers: dict[str, LlamaServer] = field(default_factory=dict)
    status: dict[str, PeerStatus] = field(default_factory=dict)
    about: str = ""  # the binary, its version and build

    def failed(self, config: str, status: PeerStatus) -> None:
        """Drop `config`'s server, keeping why."""
        server = self.servers.pop(config, None)
        if server is not None:
            server.close()
        status.name, status.build = f"llama.cpp {config}", ""  # `about` names the build
        self.status[config] = status
        print(f"  {status.line()}", flush=True)

    def close(self) -> None:
        for server in self.servers.values():
            server.close()

    def summary(self) -> list[str]:
        """The lines under the table: the build, then each configuration's status."""
        if not self.status:
            return []
        return [self.about, *(f"- {s.line()}" for s in self.status.values())]


def start_llama(args: argparse.Namespace, model_path: str) -> Peers:
    """llama-server without speculation ("off") and with each `LLAMA_SPEC` configuration; one
    that crashes at start-up is recorded, not raised."""
    peers = Peers()
    if args.no_llama:
        return peers
    binary, why = find_llama_server(args.llama_server)
    if binary is None:
        print(f"llama.cpp skipped: {why}")
        return peers
    peers.about = (
        f"llama.cpp {llama_version(binary)} ({why}): {binary}; build: {llama_build_line(binary)}"
    )
    print(peers.about, flush=True)
    threads = torch.get_num_threads()
    configs = {"off": (), **llama_speculation(args, threads)}
    for name, cfg in configs.items():
        try:
            peers.servers[name] = LlamaServer(binary, model_path, threads, cfg)
            peers.status[name] = PeerStatus(f"llama.cpp {name}")
        except PeerCrashed as exc:
            peers.failed(name, exc.status)
    return peers


def llama_speculation(args: argparse.Namespace, threads: int) -> dict[str, tuple[str, ...]]:
    """llama-server's speculative configurations to compare: with a draft model, that model
    (at sglite's draft length and at llama.cpp's default 3); else its n-gram types."""
    if args.algorithm != "draft" or args.draft_model_path is None:
        return dict(LLAMA_SPEC)
    draft = resolve_model_path(args.draft_model_path)
    base = ("-md", draft, "--spec-type", "draft-simple", "-td", str(threads), "-ngld", "0")
    return {
        f"draft model, n-max {args.num_draft_tokens}": (
            *base, "--spec-draft-n-max", str(args.num_draft_tokens)
        ),
        "draft model, n-max 3": (*base, "--spec-draft-n-max", "3"),
    }  # fmt: skip
