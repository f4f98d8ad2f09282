"""Routing policies: which healthy worker serves the next request.

A policy sees the candidates' in-flight loads (requests the balancer has sent them and not yet
seen answered) and the request's routing key (its text, or its token ids), and returns a
`Decision`. Policies keep plain state: the router calls them from its single event loop, data
parallelism under its lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from sglite.load_balancing.radix_tree import ApproxRadixTree, Key

POLICIES = ("cache_aware", "round_robin", "least_load")

# Decision kinds (the `kind` label of the decisions metric).
PREFIX_MATCH = "prefix_match"  # cache_aware: the best prefix match was good enough
LOW_MATCH = "low_match"  # cache_aware: no good match, so the least-loaded worker
IMBALANCE = "imbalance"  # cache_aware: loads too uneven, affinity overridden
ROUND_ROBIN = "round_robin"
LEAST_LOAD = "least_load"
# When a worker's tree outgrows max_tree_size it is trimmed to this fraction of it, so trimming
# (a walk over the worker's nodes) happens once per many inserts, not on every one.
EVICT_LOW_WATERMARK = 0.9
LOW_MATCH_CHOICES = ("least_load", "smallest_tree")


@dataclass(frozen=True)
class Candidate:
    """A healthy worker as a policy sees it: its URL, in-flight requests and requests routed."""

    url: str
    load: int
    routed: int = 0


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why (`kind` is one of the constants above)."""

    url: str
    kind: str


class Policy(Protocol):
    """Chooses a worker; `candidates` is never empty and lists workers in registration order."""

    name: str

    def select(self, candidates: list[Candidate], key: Key | None) -> Decision:
        """The worker for a request with routing key `key` (None: the request has no text)."""
        ...

    def routed(self, url: str, keys: list[Key]) -> None:
        """`url` was sent a request holding `keys` (a batch has several)."""
        ...

    def forget(self, url: str) -> None:
        """`url` went down or was removed: whatever it had cached is gone."""
        ...


class RoundRobin:
    """Each request to the next worker in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: list[Candidate], key: Key | None) -> Decision:
        """The next candidate in rotation (the rotation skips workers that are down)."""
        choice = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(choice.url, ROUND_ROBIN)

    def routed(self, url: str, keys: list[Key]) -> None:
        """Nothing to remember."""

    def forget(self, url: str) -> None:
        """Nothing to forget."""


def least_loaded(candidates: list[Candidate], tie_break: Mapping[str, int]) -> Candidate:
    """The candidate with the fewest in-flight requests; ties go to the smallest `tie_break`
    value, then to the first registered (so a quiet system still spreads requests)."""
    return min(candidates, key=lambda c: (c.load, tie_break.get(c.url, 0)))


class LeastLoad:
    """Each request to the worker with the fewest in-flight requests."""

    name = "least_load"

    def select(self, candidates: list[Candidate], key: Key | None) -> Decision:
        """Fewest in flight; ties to the worker routed the fewest requests so far."""
        choice = least_loaded(candidates, {c.url: c.routed for c in candidates})
        return Decision(choice.url, LEAST_LOAD)

    def routed(self, url: str, keys: list[Key]) -> None:
        """Nothing to remember."""

    def forget(self, url: str) -> None:
        """Nothing to forget."""


@dataclass(frozen=True)
class CacheAwareConfig:
    """Thresholds of the cache-aware policy (SGLang router's flags of the same names)."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**24
    # Where a request without a good prefix match (a new prefix) goes: the worker holding the
    # least text, i.e. the fewest distinct prefixes (SGLang router's choice), or the least-loaded
    # one. In a burst the loads only reflect the groups seen so far, so least_load can give one
    # worker 5 of 8 equal groups; smallest_tree splits them 4/4 (tests/test_router_policy.py).
    low_match: str = "smallest_tree"

    def __post_init__(self) -> None:
        if self.low_match not in LOW_MATCH_CHOICES:
            choices = ", ".join(LOW_MATCH_CHOICES)
            raise ValueError(f"low_match must be one of {choices} (got {self.low_match!r})")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1] (got {self.cache_threshold})")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")
        if self.max_tree_size < 1:
            raise ValueError("max_tree_size must be >= 1")


class CacheAware:
    """Send a request where its prefix was sent before, unless that would overload a worker.

    1. Loads imbalanced (max - min > abs threshold and max > min * rel threshold): least loaded.
    2. Else the worker holding the longest prefix of the key, if it covers more than
       `cache_threshold` of the key.
    3. Else (a new prefix) the worker with the smallest tree, i.e. the fewest distinct prefixes
       (ties: least loaded); or, with `low_match="least_load"`, the least-loaded worker (ties:
       the smallest tree).
    The key is then recorded as held by the chosen worker (`routed`); a worker's share of the
    tree over `max_tree_size` items loses its least recently used leaves.
    """

    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.tree = ApproxRadixTree()

    def select(self, candidates: list[Candidate], key: Key | None) -> Decision:
        """See the class docstring."""
        sizes = {c.url: self.tree.size(c.url) for c in candidates}
        if self._imbalanced(candidates):
            return Decision(least_loaded(candidates, sizes).url, IMBALANCE)
        if key:
            matched = self.tree.match(key)
            best = max(candidates, key=lambda c: (matched.get(c.url, 0), -c.load))
            if matched.get(best.url, 0) / len(key) > self.config.cache_threshold:
                return Decision(best.url, PREFIX_MATCH)
        if self.config.low_match == "smallest_tree":
            choice = min(candidates, key=lambda c: (sizes[c.url], c.load))
        else:
            choice = least_loaded(candidates, sizes)
        return Decision(choice.url, LOW_MATCH)

    def routed(self, url: str, keys: list[Key]) -> None:
        """Record that `url` now (approximately) caches every key."""
        for key in keys:
            if key:
                self.tree.insert(key, url)
        limit = self.config.max_tree_size
        if self.tree.size(url) > limit:
            self.tree.evict(url, int(limit * EVICT_LOW_WATERMARK))

    def forget(self, url: str) -> None:
        """Drop `url`'s marks: a worker that went down comes back with an empty cache."""
        self.tree.remove_worker(url)

    def _imbalanced(self, candidates: list[Candidate]) -> bool:
        loads = [c.load for c in candidates]
        high, low = max(loads), min(loads)
        cfg = self.config
        return high - low > cfg.balance_abs_threshold and high > low * cfg.balance_rel_threshold


def make_policy(name: str, config: CacheAwareConfig | None = None) -> Policy:
    """The policy called `name` (one of POLICIES)."""
    if name == "cache_aware":
        return CacheAware(config)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {name!r})")
