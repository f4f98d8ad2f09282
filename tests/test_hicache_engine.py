"""The hierarchical KV cache on the real model: spans evicted from a small pool come back from the
host tier and from disk with the same greedy output as no cache; the disk tier survives a
restart, rejects a corrupt page and is never read by another model.

Engines run in float32 so outputs compare exactly; every engine's KV and tier accounting is
checked after each test (`check_invariants` covers the tiers).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from sglite.runtime.cache.disk_store import DiskKVStore
from sglite.runtime.cache.kv_pool import KVPool

# SmolLM2-135M: 30 layers, 3 KV heads of 64 -> 46080 bytes of float32 K/V per token.
TOKEN_BYTES = KVPool.bytes_per_token(30, 3, 64, torch.float32)
POOL_TOKENS = 256
HOST_TOKENS = 250
PAGE = 16
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def document(i: int) -> str:
    """A distinct prompt of roughly 100 tokens."""
    topics = ["rivers", "volcanoes", "glaciers", "deserts", "forests", "oceans", "comets"]
    topic = topics[i % len(topics)]
    lines = [f"Report {i} on {topic}."]
    lines += [
        f"Fact {j}: the {topic} of region {i * 10 + j} change slowly over time." for j in range(7)
    ]
    return " ".join(lines) + " Summary:"


def _engine(**kwargs):
    import sglite

    # Float activations, as engine_no_cache's (conftest.py): outputs are compared exactly.
    return sglite.Engine(dtype="float32", gguf_activations="float", log_level="error", **kwargs)


def _tiers(engine) -> dict:
    return engine.get_server_info()["hicache"]


@pytest.fixture(scope="module")
def tiered_engine(tmp_path_factory):
    """A pool of 256 tokens over a host tier of 250 and a disk tier: the working set of the
    tests below (four ~110-token prompts) fits in none of the first two alone."""
    eng = _engine(
        max_total_tokens=POOL_TOKENS,
        hicache_size=HOST_TOKENS * TOKEN_BYTES / 1e9,
        hicache_dir=str(tmp_path_factory.mktemp("hicache")),
        hicache_page_size=PAGE,
        hicache_write_policy="write_back",
        hicache_load_policy="always",
    )
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def _check_tiers(request):
    yield
    if "tiered_engine" in request.fixturenames:
        info = request.getfixturevalue("tiered_engine").check_invariants()
        assert info["held_by_requests"] == 0, info


def test_evicted_prefixes_come_back_from_host_then_disk(tiered_engine, engine_no_cache):
    """P1, P2, P3 overflow the pool (P1 goes to the host tier), P1 again is a host hit; P4 then
    overflows the host tier too (P2 goes to disk) and P2 again is a disk hit."""
    prompts = {i: document(i) for i in range(1, 5)}
    reference = {i: engine_no_cache.generate(p, GREEDY)["text"] for i, p in prompts.items()}
    results = {}
    for step, i in enumerate([1, 2, 3, 1, 4, 2]):
        out = tiered_engine.generate(prompts[i], GREEDY)
        assert out["text"] == reference[i], f"step {step}: prompt {i} differs from no cache"
        results[step] = out["meta_info"]
        details = out["meta_info"]["cached_tokens_details"]
        assert sum(details.values()) == out["meta_info"]["cached_tokens"]
    assert results[3]["cached_tokens_details"]["host"] > 80, results[3]
    assert results[5]["cached_tokens_details"]["disk"] >= 80, results[5]
    tiers = _tiers(tiered_engine)
    assert tiers["host"]["hit_tokens"] > 80 and tiers["host"]["promotions"] >= 1
    assert tiers["host"]["demotions"] >= 2 and tiers["host"]["bytes_in"] > 0
    assert tiers["disk"]["hit_tokens"] >= 80 and tiers["disk"]["pages_written"] >= 5
    assert tiers["disk"]["corrupt_pages"] == 0
    assert tiered_engine.get_server_info()["hicache_costs"]["prefill_seconds_per_token"] > 0


def test_tiers_keep_outputs_under_concurrent_load(tiered_engine, engine_no_cache):
    """Many requests over a working set four times the pool, sharing prefixes: every output
    equals the no-cache one and no slot or page leaks (checked after the test)."""
    base = [document(i) for i in range(10, 14)]
    prompts = [base[i % 4] + f" Question {i}: why?" for i in range(8)]
    reference = engine_no_cache.generate(prompts, GREEDY)
    outs = tiered_engine.generate(prompts, GREEDY)
    assert [o["text"] for o in outs] == [r["text"] for r in reference]
    again = tiered_engine.generate(prompts[:4], GREEDY)
    assert [o["text"] for o in again] == [r["text"] for r in reference[:4]]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)


@pytest.mark.slow
def test_disk_tier_survives_restart_rejects_corruption_and_other_models(tmp_path):
    """Same model + same directory after a restart: disk hits and the same output. A damaged
    page is caught by its checksum and recomputed from there. A different model reads nothing.
    Sequences shorter than --min-cached-prefix are not cached."""
    cache_dir = str(tmp_path / "kv")
    shared_ids = [3 + (i * 7) % 300 for i in range(96)]  # valid ids for both models below
    flags = dict(
        max_total_tokens=4096, hicache_dir=cache_dir, hicache_page_size=PAGE, min_cached_prefix=48
    )
    short = "Tell me a short story about a cat who lives on a boat."

    first = _engine(**flags)
    try:
        ids = first.tokenizer.encode(document(42))
        cold = first.generate(input_ids=ids, sampling_params=GREEDY)
        first.generate(input_ids=shared_ids, sampling_params=GREEDY)
        first.generate(short, GREEDY)
        assert first.generate(short, GREEDY)["meta_info"]["cached_tokens"] == 0  # too short
        first.check_invariants()
    finally:
        first.shutdown()
    assert cold["meta_info"]["cached_tokens"] == 0
    full_pages = (len(ids) - 1) // PAGE  # a request matches at most len - 1 tokens

    warm_engine = _engine(**flags)
    try:
        warm = warm_engine.generate(input_ids=ids, sampling_params=GREEDY)
        warm_engine.check_invariants()
    finally:
        warm_engine.shutdown()
    assert warm["text"] == cold["text"]
    assert warm["meta_info"]["cached_tokens_details"] == {
        "device": 0, "host": 0, "disk": full_pages * PAGE
    }  # fmt: skip

    (model_dir,) = [d for d in glob.glob(os.path.join(cache_dir, "*")) if os.path.isdir(d)]
    store = DiskKVStore(cache_dir, os.path.basename(model_dir), PAGE, 30, 3, 64, torch.float32)
    victim = store._path(store.page_hashes(ids)[3])
    with open(victim, "r+b") as f:  # one flipped byte in the middle of page 3
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    checked = _engine(**flags)
    try:
        again = checked.generate(input_ids=ids, sampling_params=GREEDY)
        tiers = _tiers(checked)
        checked.check_invariants()
    finally:
        checked.shutdown()
    assert again["text"] == cold["text"]
    assert again["meta_info"]["cached_tokens_details"]["disk"] == 3 * PAGE  # pages 0-2 only
    assert tiers["disk"]["corrupt_pages"] == 1
    # The recomputed span was written through again: the page is whole once more.
    rescanned = DiskKVStore(cache_dir, os.path.basename(model_dir), PAGE, 30, 3, 64, torch.float32)
    assert rescanned.has(store.page_hashes(ids)[3]) and rescanned.verify_all() == []

    from test_model_parity import make_hf_model

    tiny_dir = str(tmp_path / "tiny-llama")
    make_hf_model("llama", tiny_dir)
    other = _engine(model_path=tiny_dir, **flags)
    try:
        out = other.generate(input_ids=shared_ids, sampling_params=GREEDY)
        tiers = _tiers(other)
    finally:
        other.shutdown()
    assert out["meta_info"]["cached_tokens"] == 0
    assert tiers["disk"]["pages_read"] == 0 and tiers["disk"]["hit_tokens"] == 0
    dirs = [d for d in glob.glob(os.path.join(cache_dir, "*")) if os.path.isdir(d)]
    assert len(dirs) == 2, "each model keeps its pages in its own directory"


@pytest.mark.slow
def test_http_server_reports_tiers(tmp_path):
    """A real server with a small pool over a host tier: a prefix evicted from the pool comes
    back as host hits in `meta_info.cached_tokens_details`, and `/get_server_info` and
    `/metrics` report the tier's hits, promotions, demotions and bytes."""
    import requests
    from server_fixtures import ServerProcess

    server = ServerProcess(
        "--max-total-tokens", str(POOL_TOKENS), "--dtype", "float32",
        "--hicache-size", str(HOST_TOKENS * TOKEN_BYTES / 1e9),
        "--hicache-write-policy", "write_back", "--hicache-load-policy", "always",
    )  # fmt: skip
    try:
        metas = []
        for i in [1, 2, 3, 1]:  # 2 and 3 push 1 out of the pool into the host tier
            r = requests.post(
                server.url + "/generate",
                json={"text": document(i), "sampling_params": GREEDY},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            metas.append(r.json()["meta_info"])
            if len(metas) == 3:  # document 1 is in the host tier only: the cache view says so
                tree = requests.get(server.url + "/cache/tree", timeout=30).json()
                assert "host" in {node["tier"] for node in tree["nodes"]}, tree["nodes"]
                assert tree["stats"]["hicache"]["host"]["tokens"] > 80
        assert metas[0]["cached_tokens"] == 0
        assert metas[3]["cached_tokens_details"]["host"] > 80, metas[3]
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
        host = info["hicache"]["host"]
        assert host["hit_tokens"] > 80 and host["promotions"] >= 1 and host["demotions"] >= 2
        assert host["bytes_in"] > 0 and host["bytes_out"] > 0
        metrics = requests.get(server.url + "/metrics", timeout=30).text
        hits = [
            line for line in metrics.splitlines()
            if line.startswith('sglite:hicache_hit_tokens_total{tier="host"')
        ]  # fmt: skip
        assert len(hits) == 1 and float(hits[0].split()[-1]) == host["hit_tokens"], hits
        assert 'sglite:hicache_demotions_total{tier="host"}' in metrics
    finally:
        server.stop()


def test_tiers_are_refused_with_tensor_parallelism():
    """Promotion fills rank 0's pool only, so tiers under TP are a clear configuration error."""
    from sglite.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs.from_kwargs(tp_size=2, hicache_size=1.0)
    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs.from_kwargs(tp_size=2, hicache_dir="/tmp/x")
