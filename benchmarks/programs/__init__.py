"""The benchmark suite's workloads (the SGLang paper's): one module per workload, each a `WORKLOAD`.

`WORKLOADS` maps each name to its `Workload` in the order of the report's table;
`get_workload(name)` looks one up. See `base.py` for what a workload is.
"""

from __future__ import annotations

from benchmarks.programs import (
    generative_agents,
    hellaswag,
    json_decode,
    llm_judge,
    mmlu,
    multi_turn_chat,
    rag,
    react,
    skeleton_of_thought,
    tree_of_thought,
)
from benchmarks.programs.base import Workload

WORKLOADS: dict[str, Workload] = {
    module.WORKLOAD.name: module.WORKLOAD
    for module in (
        mmlu,
        hellaswag,
        react,
        generative_agents,
        tree_of_thought,
        skeleton_of_thought,
        llm_judge,
        json_decode,
        multi_turn_chat,
        rag,
    )
}


def get_workload(name: str) -> Workload:
    """The workload called `name`; KeyError listing the valid names otherwise."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}") from None


__all__ = ["WORKLOADS", "Workload", "get_workload"]
