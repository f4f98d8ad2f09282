"""`RouterArgs`: every option of `sglite router`, one dataclass shared by the CLI and tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglite.load_balancing.policy import POLICIES, CacheAwareConfig
from sglite.router.workers import normalize_url

LOG_LEVELS = ("debug", "info", "warning", "error")
# Flags not spelled `--` + the field name with dashes (SGLang router's names).
FLAG_NAMES = {"prefill_urls": "--prefill", "decode_urls": "--decode"}
URL_LISTS = ("worker_urls", "prefill_urls", "decode_urls")


def flag(name: str) -> str:
    """The command-line flag of RouterArgs field `name`."""
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


@dataclass
class RouterArgs:
    """Options of the router; `validate()` raises ValueError naming the first bad one."""

    worker_urls: list[str] = field(default_factory=list)
    # PD disaggregation: each generation request goes to a prefill and a decode worker at once
    # (sglite/router/pd.py); then the workers are given as prefill_urls and decode_urls.
    pd_disaggregation: bool = False
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 30000
    # cache_aware thresholds (SGLang router's names and meaning)
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**24
    low_match_policy: str = "smallest_tree"
    # health and failures
    health_check_interval: float = 10.0
    health_check_timeout: float = 5.0
    health_failure_threshold: int = 3
    max_retries: int = 3
    # forwarding timeouts, seconds: a worker must accept a connection within connect_timeout and
    # may then stay silent for request_timeout (a non-streamed generation answers only at the end)
    connect_timeout: float = 5.0
    request_timeout: float = 1800.0
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = 16 * 1024 * 1024  # as the workers: larger bodies answer 413
    log_level: str = "info"

    def validate(self) -> None:
        """Check ranges and normalise the worker URLs in place."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {self.policy!r})")
        self._validate_worker_lists()
        self.cache_aware_config()  # raises for bad thresholds
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (got {self.port})")
        for name in ("health_check_interval", "health_check_timeout", "connect_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.request_timeout <= 0 or self.shutdown_timeout < 0:
            raise ValueError("request_timeout must be > 0 and shutdown_timeout >= 0")
        if self.health_failure_threshold < 1:
            raise ValueError("health_failure_threshold must be >= 1")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")

    def _validate_worker_lists(self) -> None:
        """Which URL lists the mode allows; each normalised, and no worker listed twice."""
        pd = ("prefill_urls", "decode_urls")
        if self.pd_disaggregation:
            if self.worker_urls:
                raise ValueError(
                    "worker_urls (--worker-urls) must be empty with --pd-disaggregation: give "
                    "the workers as --prefill and --decode"
                )
            for name in pd:
                if not getattr(self, name):
                    raise ValueError(
                        f"{name} ({flag(name)}) must list at least one worker with "
                        "--pd-disaggregation"
                    )
        else:
            for name in pd:
                if getattr(self, name):
                    raise ValueError(f"{name} ({flag(name)}) needs --pd-disaggregation")
        seen: set[str] = set()
        for name in URL_LISTS:
            urls = [normalize_url(u) for u in getattr(self, name)]
            setattr(self, name, urls)
            if len(set(urls)) != len(urls):
                raise ValueError(f"{name} ({flag(name)}) lists a worker twice")
            if both := seen & set(urls):
                raise ValueError(f"{name} ({flag(name)}): {min(both)} is in two worker lists")
            seen |= set(urls)

    def cache_aware_config(self) -> CacheAwareConfig:
        """The cache_aware policy's thresholds."""
        return CacheAwareConfig(
            cache_threshold=self.cache_threshold,
            balance_abs_threshold=self.balance_abs_threshold,
            balance_rel_threshold=self.balance_rel_threshold,
            max_tree_size=self.max_tree_size,
            low_match=self.low_match_policy,
        )
