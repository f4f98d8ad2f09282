"""Qwen3-MoE: Qwen3's attention (q/k norms) with mixture-of-experts MLPs on the layers
`decoder_sparse_step` picks, except `mlp_only_layers`; the chosen experts' weights are
renormalized when `norm_topk_prob`."""

from __future__ import annotations

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models.base import HFConfig, ModelFamily
from sglite.runtime.model.models.qwen3 import from_gguf, qwen3_fields


def _from_hf(cfg: HFConfig, arch: str) -> ModelConfig:
    # transformers >= 5 writes num_local_experts, earlier versions num_experts.
    experts = int(cfg.get("num_local_experts") or cfg.need("num_experts"))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers", []))
    count = int(cfg.need("num_hidden_layers"))
    moe = [i for i in range(count) if i not in dense and experts and (i + 1) % step == 0]
    return ModelConfig(
        **qwen3_fields(cfg, arch),
        num_experts=experts,
        num_experts_per_tok=int(cfg.need("num_experts_per_tok")),
        moe_intermediate_size=int(cfg.need("moe_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_layers=moe,
    )


FAMILY = ModelFamily(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_types=("qwen3_moe",),
    config_from_hf=_from_hf,
    gguf_architectures=("qwen3moe",),
    config_from_gguf=from_gguf,
)
