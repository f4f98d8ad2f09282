"""Data parallelism inside one server: several model replicas behind one client interface.

`DataParallelClient` starts `dp_size` scheduler groups (each a `SchedulerClient`, itself
`tp_size` processes) and offers the same methods as one `SchedulerClient`, so the tokenizer
manager, the Engine and the HTTP server do not know how many replicas there are. Each request
goes to one replica, chosen by the load-balancing policies the router also uses
(`sglite/load_balancing/policy.py`) over the request's token ids: `cache_aware` sends it where
its prefix was sent before (that replica's radix cache probably still holds it) unless loads
are imbalanced.

Invariants: a request's increments and its abort reach exactly the replica that has it; every
request of a replica that dies ends with an abort (its `SchedulerClient` does that), and the
first death is reported once to `on_death`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglite.load_balancing.policy import CacheAwareConfig, Candidate, make_policy
from sglite.runtime.scheduler.io import AbortKind, GenerateInput, RequestOutput
from sglite.runtime.scheduler_client import OutputCallback, SchedulerClient, SchedulerDiedError
from sglite.runtime.server_args import ServerArgs

# Per-replica statistics that add up across replicas in get_info.
_SUMMED = (
    "num_running_reqs",
    "num_queued_reqs",
    "max_total_num_tokens",
    "num_free_slots",
    "cache_size_tokens",
    "cached_prompt_tokens",
    "queried_prompt_tokens",
)


class DataParallelClient:
    """`dp_size` replicas behind the `SchedulerClient` interface (see module docstring)."""

    def __init__(self, args: ServerArgs, startup_timeout: float = 600.0, wait: bool = True) -> None:
        """Start every replica's processes (from this thread, see SchedulerClient); with
        `wait`, also wait until they are ready (else call `wait_ready`)."""
        self.args = args
        self.replicas: list[SchedulerClient] = [
            SchedulerClient(args, startup_timeout, wait=False) for _ in range(args.dp_size)
        ]
        self.info: dict[str, Any] = {}
        self.served_tokens: dict[str, Any] = {}
        self.policy = make_policy(args.dp_policy, CacheAwareConfig())
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}
        self._load = [0] * len(self.replicas)
        self._routed = [0] * len(self.replicas)
        self.alive = True
        self.death_reason: str | None = None
        self.on_death: Callable[[str], None] | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for every replica side by side (loading models in parallel takes one load time,
        not dp of them); raises, after stopping them all, if one fails."""
        replicas = self.replicas
        with ThreadPoolExecutor(len(replicas)) as pool:
            futures = [pool.submit(r.wait_ready) for r in replicas]
            errors = [fut.exception() for fut in futures if fut.exception() is not None]
        if errors:
            for replica in replicas:
                if replica.alive:
                    replica.shutdown()
            raise errors[0]
        self.info = dict(replicas[0].info)
        self.served_tokens = replicas[0].served_tokens
        self.info["dp_size"] = len(replicas)
        self.info["max_total_num_tokens"] = sum(r.info["max_total_num_tokens"] for r in replicas)
        for replica in replicas:
            replica.on_death = self._replica_died

    @property
    def healthy(self) -> bool:
        """True while every replica runs."""
        return self.alive and all(r.healthy for r in self.replicas)

    def submit(self, inp: GenerateInput, callback: OutputCallback) -> None:
        """Route a request to a replica; `callback` receives its increments."""
        if not self.alive:
            raise SchedulerDiedError(self.death_reason or "a replica is not running")
        key = tuple(inp.input_ids)
        with self._lock:
            candidates = [
                Candidate(str(i), self._load[i], self._routed[i]) for i in range(len(self.replicas))
            ]
            index = int(self.policy.select(candidates, key).url)
            self.policy.routed(str(index), [key])
            self._owner[inp.rid] = index
            self._load[index] += 1
            self._routed[index] += 1

        def on_output(out: RequestOutput) -> None:
            if out.finish_reason is not None:
                with self._lock:
                    if self._owner.pop(out.rid, None) is not None:
                        self._load[index] -= 1
            callback(out)

        try:
            self.replicas[index].submit(inp, on_output)
        except Exception:
            with self._lock:
                self._owner.pop(inp.rid, None)
                self._load[index] -= 1
            raise

    def abort(
        self,
        rid: str,
        message: str = "aborted by the client",
        kind: AbortKind = AbortKind.CANCELLED,
    ) -> None:
        """Stop a request on the replica that has it."""
        with self._lock:
            index = self._owner.get(rid)
        if index is not None:
            self.replicas[index].abort(rid, message, kind)

    def control(self, kind: str, timeout: float = 60.0, **args: Any) -> Any:
        """Run a control request on every replica and combine the answers (`cache_tree`: on
        the replica numbered `replica`, with the replica count)."""
        if kind == "cache_tree":
            index = args.pop("replica", 0)
            if not 0 <= index < len(self.replicas):
                raise ValueError(f"replica must be between 0 and {len(self.replicas) - 1}")
            tree = self.replicas[index].control(kind, timeout=timeout, **args)
            return {**tree, "replica": index, "replicas": len(self.replicas)}
        answers = [r.control(kind, timeout=timeout, **args) for r in self.replicas]
        if kind == "get_info":
            return self._merge_info(answers)
        if kind == "check_invariants":
            return {key: sum(a[key] for a in answers) for key in answers[0]}
        return answers[0] if all(a == answers[0] for a in answers) else answers

    def _merge_info(self, answers: list[dict[str, Any]]) -> dict[str, Any]:
        merged = dict(answers[0])
        for key in _SUMMED:
            if key in merged:
                merged[key] = sum(a.get(key, 0) for a in answers)
        for key, value in answers[0].items():
            if key not in _SUMMED and isinstance(value, int) and not isinstance(value, bool):
                merged[key] = sum(a.get(key, 0) for a in answers)  # counters
        merged["cache_hit_rate"] = merged["cached_prompt_tokens"] / max(
            1, merged["queried_prompt_tokens"]
        )
        capacity = merged["max_total_num_tokens"]
        merged["pool_usage"] = (capacity - merged["num_free_slots"]) / max(1, capacity)
        with self._lock:
            routed = list(self._routed)
        merged["dp_replicas"] = [
            {**a, "routed_requests": n} for a, n in zip(answers, routed, strict=True)
        ]
        return merged

    def _replica_died(self, reason: str) -> None:
        with self._lock:
            first = self.alive
            self.alive = False
            self.death_reason = self.death_reason or reason
        if first and self.on_death is not None:
            self.on_death(reason)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica."""
        self.alive = False
        for replica in self.replicas:
            replica.on_death = None
            replica.shutdown(timeout)


def create_client(args: ServerArgs, wait: bool = True) -> SchedulerClient | DataParallelClient:
    """The scheduler client for `args`: one replica, or a data-parallel set of them. Without
    `wait` its processes are started and loading; call `wait_ready` before using it."""
    if args.dp_size > 1:
        return DataParallelClient(args, wait=wait)
    return SchedulerClient(args, wait=wait)
