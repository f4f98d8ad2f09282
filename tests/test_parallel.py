"""Tensor parallelism (two gloo ranks on CPU) and data parallelism inside one server."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_model_parity import make_hf_model

import sglite
from sglite.runtime.distributed.sharding import TensorParallelPlan
from sglite.runtime.model.config import ModelConfig
from sglite.runtime.scheduler_client import free_port
from sglite.runtime.server_args import ServerArgs

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Three colors of the rainbow are",
]


def _config(heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig(
        arch="LlamaForCausalLM",
        vocab_size=1001,
        hidden_size=64 * heads,
        intermediate_size=300,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=64,
    )


def test_plan_splits_by_kv_groups_even_when_uneven():
    cfg = _config(9, 3)  # SmolLM2's shape
    a, b = (TensorParallelPlan.create(cfg, r, 2) for r in range(2))
    assert (a.kv_heads, a.q_heads, b.kv_heads, b.q_heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert a.intermediate == (0, 150) and b.intermediate == (150, 300)
    assert a.vocab_widths(1001) == [501, 500]
    local = a.local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (6, 2, 150)


def test_plan_replicates_kv_heads_beyond_their_count():
    cfg = _config(4, 1)
    plans = [TensorParallelPlan.create(cfg, r, 2) for r in range(2)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="cannot split"):
        TensorParallelPlan.create(_config(3, 1), 0, 2)


def test_plan_refuses_mixture_of_experts_models():
    import dataclasses

    moe = dataclasses.replace(
        _config(4, 2), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64
    )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        TensorParallelPlan.create(moe, 0, 2)


def test_shards_cut_rows_columns_and_keep_row_parallel_bias_once():
    cfg = _config(4, 2)
    plan = TensorParallelPlan.create(cfg, 1, 2)
    q = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)
    assert torch.equal(plan.shard("model.layers.0.self_attn.q_proj.weight", q), q[128:])
    o = torch.randn(256, 256)
    assert torch.equal(plan.shard("model.layers.0.self_attn.o_proj.weight", o), o[:, 128:])
    bias = torch.ones(256)
    assert plan.shard("model.layers.0.self_attn.o_proj.bias", bias).sum() == 0
    norm = torch.ones(256)
    assert plan.shard("model.layers.0.input_layernorm.weight", norm) is norm


def test_parallel_arguments_are_validated():
    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs.from_kwargs(tp_size=0)
    with pytest.raises(ValueError, match="dist-init-addr"):
        ServerArgs.from_kwargs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        ServerArgs.from_kwargs(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="HOST:PORT"):
        ServerArgs.from_kwargs(tp_size=2, dist_init_addr="nowhere")
    with pytest.raises(ValueError, match="dp_policy"):
        ServerArgs.from_kwargs(dp_size=2, dp_policy="random")


def _greedy(engine: sglite.Engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def single_default(engine):
    """TP=1 greedy outputs and weight bytes, from the session's float32 engine."""
    return _greedy(engine), sum(engine.get_server_info()["weight_bytes_per_rank"])


def test_tp2_default_model_matches_tp1_and_halves_weights(single_default):
    expected, total_bytes = single_default
    with sglite.Engine(dtype="float32", tp_size=2, log_level="error") as engine:
        info = engine.get_server_info()
        assert info["tp_size"] == 2 and info["num_threads"] >= 1
        assert _greedy(engine) == expected
        # Reused segments are copied into rank 0's pool only: refused, with the reason.
        ids = engine.tokenizer.encode("Documents: one two three four. Question:")
        refused = engine.generate(input_ids=ids, sampling_params={}, segments=[[2, 6]])
        assert "tensor parallelism" in refused["meta_info"]["finish_reason"]["message"]
        per_rank = info["weight_bytes_per_rank"]
        # 9 heads over 3 kv-head groups split 2:1, the MLP and vocabulary evenly: ~54% / ~46%.
        assert len(per_rank) == 2
        assert 0 <= sum(per_rank) - total_bytes < 0.01 * total_bytes  # norms are replicated
        assert all(0.4 < b / total_bytes < 0.6 for b in per_rank)
        followers = engine.client.followers
    assert all(proc.poll() is not None for proc in followers)  # shut down with the engine


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 1)])
def test_tp2_tiny_qwen2_matches_tp1(tmp_path, heads, kv_heads):
    make_hf_model("qwen2", str(tmp_path), num_attention_heads=heads, num_key_value_heads=kv_heads)
    prompts = [[1, 17, 45, 3, 99], [1, 260, 7, 7, 12, 301, 88]]
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    outs = {}
    for tp in (1, 2):
        kwargs = {"model_path": str(tmp_path), "dtype": "float32", "log_level": "error"}
        with sglite.Engine(tp_size=tp, **kwargs) as engine:
            outs[tp] = [
                o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)
            ]
    assert outs[1] == outs[2]


@pytest.mark.slow
def test_multi_node_flags_on_one_machine(single_default):
    """Node 1 of 2 runs its rank through `sglite serve --node-rank 1`; node 0 is the Engine."""
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen(
        [
            sys.executable, "-m", "sglite.launch_server", "--tp-size", "2", "--nnodes", "2",
            "--node-rank", "1", "--dist-init-addr", addr, "--dtype", "float32",
            "--log-level", "error",
        ]
    )  # fmt: skip
    try:
        with sglite.Engine(
            dtype="float32", tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr,
            log_level="error",
        ) as engine:  # fmt: skip
            assert _greedy(engine) == single_default[0]
        assert node1.wait(timeout=60) == 0  # its rank exits when rank 0 stops
    finally:
        if node1.poll() is None:
            node1.kill()


def _grouped_prompts(groups: int, per_group: int) -> list[str]:
    return [
        f"Group {g} context: " + f"fact {g} is long and specific. " * 40 + f"Question {i}?"
        for g in range(groups)
        for i in range(per_group)
    ]


@pytest.fixture(scope="module")
def dp_cache_aware():
    """Two replicas behind the cache-aware policy (the default), shared by the DP tests."""
    with sglite.Engine(dtype="float32", dp_size=2, log_level="error") as engine:
        yield engine


def _routed(engine: sglite.Engine) -> list[int]:
    return [r["routed_requests"] for r in engine.get_server_info()["dp_replicas"]]


def _hit_rate(engine: sglite.Engine, prompts: list[str]) -> tuple[float, list[int]]:
    engine.flush_cache()
    before = engine.get_server_info()
    routed = _routed(engine)
    engine.generate(prompts, {"temperature": 0, "max_new_tokens": 2})
    after = engine.get_server_info()
    assert engine.client.control("check_invariants")["held_by_requests"] == 0
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    queried = after["queried_prompt_tokens"] - before["queried_prompt_tokens"]
    return cached / queried, [b - a for a, b in zip(routed, _routed(engine))]


def test_dp_cache_aware_keeps_prefixes_together_and_beats_round_robin(dp_cache_aware):
    prompts = _grouped_prompts(4, 4)
    aware, aware_split = _hit_rate(dp_cache_aware, prompts)
    with sglite.Engine(
        dtype="float32", dp_size=2, dp_policy="round_robin", log_level="error"
    ) as engine:
        robin, robin_split = _hit_rate(engine, prompts)
    assert sum(aware_split) == sum(robin_split) == 16
    assert robin_split == [8, 8]
    # Each group's prefix is computed once with cache_aware, once per replica with round robin.
    assert aware > robin + 0.1, (aware, robin)


def test_dp_same_prefix_lands_on_one_replica(dp_cache_aware):
    engine = dp_cache_aware
    engine.flush_cache()
    routed = _routed(engine)
    prefix = "You are a careful assistant who answers briefly. " * 12
    first = engine.generate(prefix + "Hi!", {"temperature": 0, "max_new_tokens": 2})
    later = engine.generate(
        [prefix + f"Question {i}?" for i in range(3)], {"temperature": 0, "max_new_tokens": 2}
    )
    assert first["meta_info"]["cached_tokens"] == 0
    assert all(o["meta_info"]["cached_tokens"] > 100 for o in later)
    assert sorted(b - a for a, b in zip(routed, _routed(engine))) == [0, 4]
