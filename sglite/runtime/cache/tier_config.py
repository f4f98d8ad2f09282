"""Settings and counters of the hierarchical cache (host and disk tiers under the radix tree)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

WRITE_POLICIES = ("write_through", "write_back")
EVICTION_POLICIES = ("lru", "benefit")
TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class HiCacheConfig:
    """How the tiered cache behaves (built from ServerArgs by `cache/factory.py`).

    - `host_tokens`: host tier capacity in tokens (0 = no host tier).
    - `disk_dir`: root of the disk tier's page files (None = no disk tier).
    - `write_policy`: `write_through` copies a span to the lower tiers when it is inserted, so
      eviction from the pool only drops the device copy; `write_back` copies on eviction.
    - `eviction_policy`: `lru`, or `benefit` (keep what is hit often and costly to restore).
    - `load_policy`: `auto` loads a span from a tier only when that beats recomputing it;
      `always` / `never` force the choice (tests and benchmarks).
    """

    host_tokens: int = 0
    host_quantize: bool = False
    disk_dir: str | None = None
    page_size: int = 32
    write_policy: str = "write_through"
    eviction_policy: str = "lru"
    load_policy: str = "auto"

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"radix_eviction_policy must be one of {EVICTION_POLICIES}")
        if self.load_policy not in ("auto", "always", "never"):
            raise ValueError("hicache load_policy must be auto, always or never")
        if self.page_size < 1:
            raise ValueError(f"hicache_page_size must be >= 1, got {self.page_size}")


@dataclass
class TierStats:
    """Cumulative counters of one tier (tokens unless named bytes).

    `hit_tokens`: admitted prompt tokens served from this tier. `promotions`: spans loaded from
    this tier into the device pool. `demotions`: spans written into this tier when evicted from
    the tier above; `stored_tokens` also counts write-through copies. `evicted_tokens`: tokens
    dropped from this tier. `bytes_in` / `bytes_out`: bytes written to / read from the tier.
    `skipped_loads`: spans recomputed because loading them would have cost more.
    """

    hit_tokens: int = 0
    promotions: int = 0
    promoted_tokens: int = 0
    demotions: int = 0
    stored_tokens: int = 0
    evicted_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    skipped_loads: int = 0

    def as_dict(self) -> dict[str, int]:
        """Plain dict for get_server_info."""
        return asdict(self)
