"""Unit tests of the hierarchical cache on a tiny pool (no model): tiers, promotion, demotion,
disk pages, restart, corruption, model isolation, adaptive policies and the invariants."""

from __future__ import annotations

import os

import pytest
import torch
from hicache_helpers import (
    DIM,
    HEADS,
    LAYERS,
    assert_kv,
    cache_sequence,
    conserved,
    make_tiered,
    write_kv,
)

from sglite.runtime.cache.cost_model import TierCostModel
from sglite.runtime.cache.disk_store import DiskKVStore
from sglite.runtime.cache.factory import hicache_config
from sglite.runtime.cache.host_pool import HostKVPool
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.model_key import model_key
from sglite.runtime.cache.tree_node import MemoryTier
from sglite.runtime.server_args import ServerArgs

A = list(range(100, 116))  # 16 tokens
B = list(range(200, 216))
C = list(range(300, 316))


def test_no_flags_means_the_plain_cache() -> None:
    assert hicache_config(ServerArgs()) is None
    assert hicache_config(ServerArgs(radix_eviction_policy="benefit")) is not None


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"hicache_size": -1}, "hicache_size"),
        ({"hicache_write_policy": "sometimes"}, "hicache_write_policy"),
        ({"radix_eviction_policy": "mru"}, "radix_eviction_policy"),
        ({"hicache_page_size": 0}, "hicache_page_size"),
        ({"min_cached_prefix": -2}, "min_cached_prefix"),
        ({"hicache_quantize": True}, "hicache_quantize"),
        ({"hicache_size": 1.0, "disable_radix_cache": True}, "disable_radix_cache"),
    ],
)
def test_bad_flags_are_named(kwargs, flag) -> None:
    with pytest.raises(ValueError, match=flag):
        ServerArgs.from_kwargs(**kwargs)


def test_eviction_demotes_to_host_and_a_match_promotes_back() -> None:
    pool, cache = make_tiered(capacity=32, host_tokens=64)
    assert cache_sequence(pool, cache, A) == 0
    assert cache_sequence(pool, cache, B) == 0
    cache_sequence(pool, cache, C)  # pool holds 32: A (least recent) goes to the host tier
    conserved(pool, cache)
    match = cache.match_prefix(A)
    assert len(match.slots) == 0 and match.host_len == 16
    assert match.last_node.tier is MemoryTier.HOST
    info = cache.tier_info()
    assert info["host"]["tokens"] >= 16 and info["host"]["demotions"] >= 1

    found = cache.load_prefix(A)
    assert (found.device, found.host, found.disk) == (0, 16, 0)
    assert_kv(pool, A, found.slots)
    assert cache.tier_info()["host"]["promoted_tokens"] == 16
    conserved(pool, cache)


def test_write_through_copies_at_insert_and_eviction_only_drops_the_device_copy() -> None:
    pool, cache = make_tiered(capacity=32, host_tokens=64, write_policy="write_through")
    cache_sequence(pool, cache, A)
    stats = cache.tier_info()["host"]
    assert stats["tokens"] == 16 and stats["stored_tokens"] == 16
    conserved(pool, cache)  # also compares the device and host copies
    cache_sequence(pool, cache, B)
    cache_sequence(pool, cache, C)
    assert cache.tier_info()["host"]["stored_tokens"] == 48  # eviction copied nothing more
    assert_kv(pool, A, cache.load_prefix(A).slots)
    conserved(pool, cache)


def test_host_full_spills_to_disk_and_disk_pages_come_back(tmp_path) -> None:
    pool, cache = make_tiered(capacity=32, host_tokens=16, disk_dir=str(tmp_path), page_size=4)
    for seq in (A, B, C, list(range(400, 416))):
        cache_sequence(pool, cache, seq)
        conserved(pool, cache)
    assert cache.match_prefix(A).last_node is cache.root  # gone from the tree...
    assert cache.tier_info()["disk"]["pages"] >= 4  # ...but its pages are on disk
    found = cache.load_prefix(A)
    assert (found.device, found.host, found.disk) == (0, 0, 16)
    assert_kv(pool, A, found.slots)
    conserved(pool, cache)


def test_restart_reads_the_previous_runs_pages(tmp_path) -> None:
    pool, cache = make_tiered(disk_dir=str(tmp_path), write_policy="write_through")
    cache_sequence(pool, cache, A + [7, 8])  # 18 tokens: 4 full pages + 2 tokens unstored
    assert cache.tier_info()["disk"]["pages"] == 4

    pool2, cache2 = make_tiered(disk_dir=str(tmp_path), write_policy="write_through")
    assert cache2.disk.num_pages == 4
    found = cache2.load_prefix(A + [7, 8])
    assert found.disk == 16 and found.device == 0
    assert_kv(pool2, A, found.slots)
    # The loaded span is in the tree now: the next match is a device hit.
    assert len(cache2.match_prefix(A).slots) == 16
    conserved(pool2, cache2)


def test_a_corrupt_page_is_discarded_and_never_served(tmp_path) -> None:
    pool, cache = make_tiered(disk_dir=str(tmp_path), write_policy="write_through")
    cache_sequence(pool, cache, A)
    hashes = cache.disk.page_hashes(A)
    path = cache.disk._path(hashes[2])
    with open(path, "r+b") as f:  # flip one byte of the payload
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))

    pool2, cache2 = make_tiered(disk_dir=str(tmp_path), write_policy="write_through")
    found = cache2.load_prefix(A)
    assert found.disk == 8  # pages 0 and 1; page 2 failed its checksum
    assert_kv(pool2, A, found.slots)
    assert cache2.disk.stats.corrupt_pages == 1
    assert not os.path.exists(path) and not cache2.disk.has(hashes[2])
    # Computing the rest writes a good page again.
    assert cache_sequence(pool2, cache2, A) == 8
    assert cache2.disk.has(hashes[2]) and cache2.disk.verify_all() == []


def test_another_model_never_reads_these_pages(tmp_path) -> None:
    pool, cache = make_tiered(disk_dir=str(tmp_path), write_policy="write_through")
    cache_sequence(pool, cache, A)
    other_key = "1" * 32
    pool2, cache2 = make_tiered(disk_dir=str(tmp_path), model_key=other_key)
    assert cache2.disk.num_pages == 0
    found = cache2.load_prefix(A)
    assert found.disk == 0 and cache2.disk.stats.pages_read == 0
    assert set(cache.disk.page_hashes(A)).isdisjoint(cache2.disk.page_hashes(A))


def test_model_key_follows_content_dtype_and_config(tmp_path) -> None:
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"weights-v1")
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(b"weights-v1")
    cfg = {"arch": "llama", "layers": 2}
    key = model_key(str(weights), cfg, "float32", "cpu", "none", 8)[0]
    assert key == model_key(str(copy), cfg, "float32", "cpu", "none", 8)[0]
    assert key != model_key(str(weights), cfg, "bfloat16", "cpu", "none", 8)[0]
    assert key != model_key(str(weights), {**cfg, "layers": 3}, "float32", "cpu", "none", 8)[0]
    assert key != model_key(str(weights), cfg, "float32", "cpu", "int8", 8)[0]
    weights.write_bytes(b"weights-v2")
    assert key != model_key(str(weights), cfg, "float32", "cpu", "none", 8)[0]


def test_insert_adopts_slots_for_host_only_nodes() -> None:
    pool, cache = make_tiered(capacity=32, host_tokens=64)
    cache_sequence(pool, cache, A)
    cache.evict(16)
    assert cache.match_prefix(A).host_len == 16
    slots = pool.alloc(20)  # a request that recomputed A and 4 more tokens
    write_kv(pool, A + [1, 2, 3, 4], slots)
    assert cache.insert(A + [1, 2, 3, 4], slots) == 0  # nothing of it was on the device
    match = cache.match_prefix(A + [1, 2, 3, 4])
    assert match.slots == slots and match.host_len == 0
    conserved(pool, cache)  # the refreshed host copy agrees with the device copy


def test_locked_spans_are_never_demoted() -> None:
    pool, cache = make_tiered(capacity=32, host_tokens=64)
    cache_sequence(pool, cache, A)
    node = cache.match_prefix(A).node
    cache.lock(node)
    assert cache.evict(32) == 0
    assert len(cache.match_prefix(A).slots) == 16
    cache.unlock(node)
    assert cache.evict(32) == 16
    conserved(pool, cache)


def test_promotion_stops_when_the_pool_is_locked_full() -> None:
    pool, cache = make_tiered(capacity=32, host_tokens=64)
    cache_sequence(pool, cache, A)
    cache.evict(16)
    held = pool.alloc(pool.num_free)  # a running request holds every free slot
    found = cache.load_prefix(A)
    assert found.host == 0 and found.slots == []
    pool.free(held)
    conserved(pool, cache)


def test_benefit_eviction_keeps_the_hot_span() -> None:
    pool, cache = make_tiered(capacity=32, eviction_policy="benefit")
    cache_sequence(pool, cache, A)
    for _ in range(5):  # A is admitted often
        node = cache.match_prefix(A).node
        cache.record_hits(node, {"device": 16})
    cache_sequence(pool, cache, B)  # B is more recent but never hit
    cache_sequence(pool, cache, C)  # room for C: the benefit policy evicts B, LRU would take A
    assert len(cache.match_prefix(A).slots) == 16
    assert len(cache.match_prefix(B).slots) == 0
    conserved(pool, cache)


def test_auto_load_policy_recomputes_when_loading_is_slower() -> None:
    pool, cache = make_tiered(capacity=32, host_tokens=64, load_policy="auto")
    cache_sequence(pool, cache, A)
    cache.evict(16)
    cache.costs.bandwidth["host"] = 1.0  # one byte per second: loading is hopeless
    cache.costs.observe_prefill(100, 0.1)
    found = cache.load_prefix(A)
    assert found.host == 0 and cache.tier_info()["host"]["skipped_loads"] == 1
    cache.costs.bandwidth["host"] = 1e12
    assert cache.load_prefix(A).host == 16


def test_cost_model_compares_load_and_recompute() -> None:
    costs = TierCostModel(bytes_per_token={"host": 1000, "disk": 1000})
    costs.observe_prefill(tokens=100, seconds=0.1)  # 1 ms per token
    costs.bandwidth["host"] = 1e9  # 1 us per token plus a fixed cost
    assert costs.should_load("host", 100)
    costs.bandwidth["disk"] = 1e5  # 10 ms per token
    assert not costs.should_load("disk", 100)
    assert costs.miss_cost_per_token("host") < costs.miss_cost_per_token(None)


def test_cost_model_learns_the_per_token_cost_from_real_prefills_only() -> None:
    # A 1-token pass costs about a decode step (here 30 ms); counted as a sample it would make
    # every recompute look 30x dearer than the 1 ms per token the long passes show.
    costs = TierCostModel(bytes_per_token={"host": 1000, "disk": 1000})
    costs.observe_prefill(tokens=1, seconds=0.03)
    assert costs.prefill_samples == 0
    costs.observe_prefill(tokens=500, seconds=0.5)
    for _ in range(20):
        costs.observe_prefill(tokens=1, seconds=0.03)
    assert costs.recompute_seconds(100) == pytest.approx(0.1)


def test_quantized_host_tier_holds_more_and_stays_close() -> None:
    exact = HostKVPool.token_bytes(30, 3, 64, torch.bfloat16, quantize=False)
    assert HostKVPool.token_bytes(30, 3, 64, torch.bfloat16, quantize=True) < 0.6 * exact
    pool, cache = make_tiered(capacity=32, host_tokens=64, quantize=True)
    cache_sequence(pool, cache, A)
    cache.evict(16)
    found = cache.load_prefix(A)
    assert found.host == 16
    assert_kv(pool, A, found.slots, atol=1000 / 127)  # within half an int8 step of |max|
    conserved(pool, cache)


def test_flush_empties_device_and_host_but_keeps_disk(tmp_path) -> None:
    pool, cache = make_tiered(host_tokens=64, disk_dir=str(tmp_path), write_policy="write_through")
    cache_sequence(pool, cache, A)
    cache.flush()
    assert pool.num_free == pool.capacity and cache.host.num_free == cache.host.capacity
    assert cache.load_prefix(A).disk == 16
    conserved(pool, cache)


def test_disk_page_round_trip_and_verification(tmp_path) -> None:
    store = DiskKVStore(str(tmp_path), "k" * 32, 4, LAYERS, HEADS, DIM, torch.float32)
    kv = torch.randn(2, LAYERS, 4, HEADS, DIM)
    (page,) = store.page_hashes([1, 2, 3, 4, 5])  # the partial second page has no hash
    assert store.write_page(page, [1, 2, 3, 4], kv) > 0
    assert store.write_page(page, [1, 2, 3, 4], kv) == 0  # immutable, written once
    assert torch.equal(store.read_page(page, [1, 2, 3, 4]), kv)
    assert not [n for _, _, files in os.walk(tmp_path) for n in files if n.endswith(".tmp")]
    assert store.read_page(page, [1, 2, 3, 9]) is None  # tokens must match the header
    assert store.stats.corrupt_pages == 1 and not store.has(page)


def test_tier_invariants_catch_a_leak_and_disagreeing_copies() -> None:
    pool, cache = make_tiered(capacity=32, host_tokens=64, write_policy="write_through")
    cache_sequence(pool, cache, A)
    node = cache.match_prefix(A).node
    pool.k[0][node.slots[3]] += 1.0  # the device copy drifts from the host copy
    with pytest.raises(AssertionError, match="copies differ"):
        cache.check_invariants()
    pool.k[0][node.slots[3]] -= 1.0
    cache.host.alloc(1)  # a host slot owned by nobody
    with pytest.raises(AssertionError, match="host tier leak"):
        cache.check_invariants()


def test_kvpool_shape_matches_host_pool() -> None:
    pool = KVPool(8, LAYERS, HEADS, DIM, torch.float32)
    host = HostKVPool(8, LAYERS, HEADS, DIM, torch.float32)
    assert host.bytes_per_token() == KVPool.bytes_per_token(LAYERS, HEADS, DIM, torch.float32)
    slots = pool.alloc(3)
    write_kv(pool, [5, 6, 7], slots)
    host_slots = host.alloc(3)
    host.save(pool, slots, host_slots)
    back = pool.alloc(3)
    host.load(pool, host_slots, back)
    assert_kv(pool, [5, 6, 7], back)
