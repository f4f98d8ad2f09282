"""Recompute-versus-load costs that drive adaptive caching.

Two running estimates, each an exponential moving average seeded at startup:
- the prefill cost per token (seconds), from the scheduler's prefill passes;
- per tier, the load bandwidth (bytes/s) and a fixed cost per transfer (seconds), from measured
  promotions (the host tier is also timed once at startup with a small copy).

`should_load` says whether bringing a span back from a tier is cheaper than computing it again;
`miss_cost_per_token` is what losing a token from the device costs, for benefit-based eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of a new sample in the moving averages: reacts within ~10 samples, ignores one outlier.
_EMA = 0.2
# Before the first prefill is measured: a guess on the fast side for a CPU, so recomputing looks
# cheap and cached spans are not overvalued; the first measurement replaces it within a pass.
_DEFAULT_PREFILL_S_PER_TOKEN = 1e-4
# Prefill passes shorter than this are not samples: a pass of a few tokens costs about one
# decode step (every weight read once) whatever its length, so its time per token overstates
# what recomputing a span adds to an extend.
MIN_PREFILL_SAMPLE_TOKENS = 32
_DEFAULT_BANDWIDTH = {"host": 2e9, "disk": 5e8}
_DEFAULT_OVERHEAD_S = {"host": 2e-4, "disk": 1e-3}


@dataclass
class TierCostModel:
    """Running estimates of load and recompute costs (see the module docstring)."""

    bytes_per_token: dict[str, int]  # per tier: bytes moved to load one token
    prefill_s_per_token: float = _DEFAULT_PREFILL_S_PER_TOKEN
    bandwidth: dict[str, float] = field(default_factory=lambda: dict(_DEFAULT_BANDWIDTH))
    overhead_s: dict[str, float] = field(default_factory=lambda: dict(_DEFAULT_OVERHEAD_S))
    prefill_samples: int = 0

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Record one prefill pass that computed `tokens` tokens in `seconds` (passes shorter
        than MIN_PREFILL_SAMPLE_TOKENS are ignored)."""
        if tokens < MIN_PREFILL_SAMPLE_TOKENS or seconds <= 0:
            return
        sample = seconds / tokens
        if self.prefill_samples == 0:
            self.prefill_s_per_token = sample
        else:
            self.prefill_s_per_token += _EMA * (sample - self.prefill_s_per_token)
        self.prefill_samples += 1

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """Record one transfer of `nbytes` from `tier` into the device pool."""
        if nbytes <= 0 or seconds <= 0:
            return
        # The fixed cost is not separated from the bandwidth per sample; charging the whole
        # time to bandwidth errs towards recomputing, the safe side.
        sample = nbytes / seconds
        self.bandwidth[tier] += _EMA * (sample - self.bandwidth[tier])

    def load_seconds(self, tier: str, tokens: int) -> float:
        """Estimated time to bring `tokens` tokens back from `tier`."""
        if tokens <= 0:
            return 0.0
        nbytes = tokens * self.bytes_per_token[tier]
        return self.overhead_s[tier] + nbytes / self.bandwidth[tier]

    def recompute_seconds(self, tokens: int) -> float:
        """Estimated time to prefill `tokens` tokens again."""
        return max(0, tokens) * self.prefill_s_per_token

    def should_load(self, tier: str, tokens: int) -> bool:
        """True when loading `tokens` tokens from `tier` beats recomputing them.

        Until a prefill has been timed there is nothing to compare with, and a copy is far
        cheaper than a forward pass on any machine we know, so the first requests load (the
        first request after a restart is exactly the one the disk tier is for).
        """
        if tokens <= 0:
            return False
        if self.prefill_samples == 0:
            return True
        return self.load_seconds(tier, tokens) < self.recompute_seconds(tokens)

    def miss_cost_per_token(self, backed_by: str | None) -> float:
        """What evicting one token costs when it is next needed: a load from the tier that keeps
        a copy (`backed_by`), or a recompute when none does (or recomputing is cheaper)."""
        recompute = self.prefill_s_per_token
        if backed_by is None:
            return recompute
        per_token = self.bytes_per_token[backed_by] / self.bandwidth[backed_by]
        return min(recompute, per_token)

    def snapshot(self) -> dict[str, float]:
        """The current estimates, for get_server_info."""
        out = {"prefill_seconds_per_token": self.prefill_s_per_token}
        for tier, bw in self.bandwidth.items():
            out[f"{tier}_load_bytes_per_second"] = bw
        return out
