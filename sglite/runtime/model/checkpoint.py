"""Copying checkpoint tensors into a model's parameters.

Checkpoints arrive under canonical names: Hugging Face Llama names (`model.layers.N.self_attn.
q_proj.weight`, `...mlp.experts.E.gate_proj.weight`, ...), into which each family
(`models/`) renames its own. The model fuses some of them (`Linear.fused`: q/k/v, gate/up): a
checkpoint projection next to a fused one is copied into its rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from sglite.runtime.distributed.sharding import TensorParallelPlan
from sglite.runtime.model.linear import Linear

logger = logging.getLogger(__name__)


def fused_parts(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint projection path -> (fused module path, part index), for every fused Linear."""
    parts: dict[str, tuple[str, int]] = {}
    for path, module in model.named_modules():
        if isinstance(module, Linear) and module.part_names:
            owner = path.rpartition(".")[0]
            for index, name in enumerate(module.part_names):
                parts[f"{owner}.{name}" if owner else name] = (path, index)
    return parts


def checkpoint_names(model: nn.Module, module_path: str) -> list[str]:
    """Canonical weight names whose rows make up the (possibly fused) projection."""
    module = model.get_submodule(module_path)
    if isinstance(module, Linear) and module.part_names:
        owner = module_path.rpartition(".")[0]
        return [f"model.{owner}.{name}.weight" for name in module.part_names]
    return [f"model.{module_path}.weight"]


class CheckpointLoader:
    """Copies canonical-named tensors into `model`'s parameters, cutting each to this rank's
    part with a tensor-parallel `plan`."""

    def __init__(self, model: nn.Module, plan: TensorParallelPlan | None, tied: bool) -> None:
        self.model = model
        self.plan = plan
        self.tied = tied
        self.parts = fused_parts(model)

    def target(self, name: str) -> tuple[str, int | None]:
        """The parameter a checkpoint tensor goes to, and its part index in a fused one."""
        module, _, kind = name.rpartition(".")
        if module in self.parts:
            fused, index = self.parts[module]
            return f"{fused}.{kind}", index
        return name, None

    def expected_parts(self, target: str) -> set[int]:
        module = self.model.get_submodule(target.rpartition(".")[0])
        count = len(module.part_names) if isinstance(module, Linear) else 0
        return set(range(count)) if count > 1 else {-1}

    def part_view(self, target: str, param: torch.Tensor, part: int) -> torch.Tensor:
        module = self.model.get_submodule(target.rpartition(".")[0])
        assert isinstance(module, Linear)
        start = sum(module.part_sizes[:part])
        return param.data[start : start + module.part_sizes[part]]

    def load(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        on_loaded: Callable[[str], None] | None = None,
        provided: frozenset[str] = frozenset(),
    ) -> None:
        """Copy every tensor in; `on_loaded(target)` is called as soon as a parameter has all
        its parts (it may replace the parameter, e.g. quantize and free it, so that loading
        never holds every dense weight at once). Parameters in `provided` are held otherwise:
        tensors for them are ignored and none are expected.

        Raises ValueError on a shape mismatch or when some parameter was never provided.
        """
        params: dict[str, nn.Parameter | None] = {
            name: p for name, p in self.model.named_parameters() if name not in provided
        }
        filled: dict[str, set[int]] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("lm_head.") and self.tied:
                continue  # tied: the embedding is the output projection
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            target, part = self.target(name)
            if target not in params:
                logger.warning("ignoring unexpected checkpoint tensor %s", name)
                continue
            param = params[target]
            if param is None:
                logger.warning("ignoring checkpoint tensor %s: its parameter is complete", name)
                continue
            if self.plan is not None:
                tensor = self.plan.shard(name, tensor)
            dest = param.data if part is None else self.part_view(target, param, part)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled.setdefault(target, set()).add(-1 if part is None else part)
            if on_loaded is not None and filled[target] == self.expected_parts(target):
                params[target] = param = dest = None  # held no longer, should it be replaced
                on_loaded(target)
        missing = [t for t in params if filled.get(t, set()) != self.expected_parts(t)]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")
