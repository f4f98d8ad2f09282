"""Mixtral: Mistral's block with a mixture of experts for every MLP (softmax over the router's
logits, the top `num_experts_per_tok`, their weights renormalized). Its GGUF files are
llama.cpp's `llama` architecture with experts, served by the Llama family."""

from __future__ import annotations

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models.base import HFConfig, ModelFamily, hf_common


def _from_hf(cfg: HFConfig, arch: str) -> ModelConfig:
    window = cfg.get("sliding_window")
    return ModelConfig(
        **hf_common(cfg, arch),
        sliding_window=int(window) if window is not None else None,
        num_experts=int(cfg.need("num_local_experts")),
        num_experts_per_tok=int(cfg.need("num_experts_per_tok")),
        moe_intermediate_size=int(cfg.need("intermediate_size")),
        norm_topk_prob=True,
    )


FAMILY = ModelFamily(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    hf_model_types=("mixtral",),
    config_from_hf=_from_hf,
    hf_renames={"block_sparse_moe": "mlp", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
)
