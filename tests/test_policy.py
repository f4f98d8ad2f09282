"""Scheduling policies: lpm and dfs-weight order as designed, and the starvation bound holds."""

from __future__ import annotations

import torch

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.detokenizer import StopChecker
from sglite.runtime.sampling.params import SamplingParams
from sglite.runtime.sampling.request_state import SamplingInfo
from sglite.runtime.scheduler.policy import order_waiting
from sglite.runtime.scheduler.request import Req


def _req(rid: str, ids: list[int], arrival: float) -> Req:
    params = SamplingParams.from_dict({"max_new_tokens": 4})
    return Req(
        rid=rid,
        prompt_ids=ids,
        params=params,
        sampling=SamplingInfo.create(params, ids, "cpu"),
        detokenizer=None,  # type: ignore[arg-type]  # not used by the policy
        stop_checker=StopChecker([], []),
        arrival_time=arrival,
    )


def _cache_with(*seqs: list[int]) -> RadixCache:
    pool = KVPool(256, 1, 1, 2, torch.float32)
    cache = RadixCache(pool)
    for seq in seqs:
        cache.insert(seq, pool.alloc(len(seq)))
    return cache


def test_lpm_puts_longest_cached_prefix_first():
    cache = _cache_with([1, 2, 3, 4, 5, 6, 7, 8])
    reqs = [
        _req("none", [9, 9, 9, 9], arrival=0.0),
        _req("short", [1, 2, 9, 9], arrival=1.0),
        _req("long", [1, 2, 3, 4, 5, 6, 9], arrival=2.0),
    ]
    order = order_waiting(reqs, "lpm", cache, now=3.0, starvation_timeout=100)
    assert [r.rid for r in order] == ["long", "short", "none"]


def test_fcfs_is_arrival_order():
    cache = _cache_with([1, 2, 3, 4])
    reqs = [_req("b", [1, 2, 3, 9], 2.0), _req("a", [7, 7], 1.0)]
    assert [r.rid for r in order_waiting(reqs, "fcfs", cache, 3.0, 100)] == ["a", "b"]


def test_dfs_weight_groups_requests_sharing_a_prefix():
    cache = _cache_with([1, 1, 1, 1, 1], [2, 2, 2, 2, 2])
    # Arrival interleaves the two groups; dfs-weight runs the heavier group (3 reqs) first,
    # and keeps each group together.
    reqs = [
        _req("a1", [1, 1, 1, 1, 1, 5], 0.0),
        _req("b1", [2, 2, 2, 2, 2, 5], 1.0),
        _req("a2", [1, 1, 1, 1, 1, 6], 2.0),
        _req("b2", [2, 2, 2, 2, 2, 6], 3.0),
        _req("a3", [1, 1, 1, 1, 1, 7], 4.0),
    ]
    order = [r.rid for r in order_waiting(reqs, "dfs-weight", cache, 5.0, 100)]
    assert order == ["a1", "a2", "a3", "b1", "b2"]


def test_starvation_bound_overrides_lpm():
    cache = _cache_with([1, 2, 3, 4, 5, 6, 7, 8])
    old = _req("old-no-hit", [9, 9, 9], arrival=0.0)
    new = _req("new-hit", [1, 2, 3, 4, 5, 6, 7, 9], arrival=50.0)
    order = order_waiting([new, old], "lpm", cache, now=60.0, starvation_timeout=30.0)
    assert order[0].rid == "old-no-hit"
    fresh = order_waiting([new, old], "lpm", cache, now=20.0, starvation_timeout=30.0)
    assert fresh[0].rid == "new-hit"
