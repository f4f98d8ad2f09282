"""What a model family is: how its Hugging Face `config.json` and GGUF metadata become a
`ModelConfig`, how its checkpoint names become the canonical ones (`checkpoint.py`), and its chat
defaults. The helpers here read the fields most families share; a family's module adds its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sglite.runtime.model.config import ModelConfig

if TYPE_CHECKING:
    from sglite.runtime.model.gguf_index import GGUFFile

Weights = Iterable[tuple[str, torch.Tensor]]


class HFConfig:
    """A `config.json` (its `text_config` for multimodal wrappers) with errors that name the file
    and the missing field."""

    def __init__(self, raw: dict[str, Any], path: str) -> None:
        self.raw = dict(raw.get("text_config") or raw)
        self.outer = raw
        self.path = path
        self.model_dir = os.path.dirname(path)

    def need(self, key: str) -> Any:
        """A field that must be present."""
        if self.raw.get(key) is None:
            raise ValueError(f"{self.path}: config.json has no {key!r}, which this model needs")
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        """An optional field (None counts as absent)."""
        value = self.raw.get(key)
        return default if value is None else value


class GGUFConfig:
    """A GGUF file's `{arch}.*` metadata with errors that name the file and the missing key."""

    def __init__(self, gf: GGUFFile, path: str) -> None:
        self.gf = gf
        self.path = path
        self.arch = str(gf.field("general.architecture"))

    def need(self, key: str) -> Any:
        value = self.gf.field(f"{self.arch}.{key}")
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata has no {self.arch}.{key}")
        return value

    def get(self, key: str, default: Any = None) -> Any:
        value = self.gf.field(f"{self.arch}.{key}")
        return default if value is None else value


def rope_from_hf(cfg: HFConfig, layer_type: str = "full_attention") -> tuple[float, dict | None]:
    """(theta, scaling) of one layer type. transformers >= 5 writes `rope_parameters` (theta
    included, per layer type for Gemma 3); older files use `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    if params and "rope_theta" not in params and "rope_type" not in params:
        params = dict(params.get(layer_type) or {})  # per-layer-type form
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") if layer_type == "full_attention" else None
    scaling = scaling or params or None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    return theta, scaling


def hf_eos_ids(cfg: HFConfig) -> list[int]:
    """Stop tokens of `generation_config.json` then `config.json`."""
    from sglite.runtime.model.tokenizer_files import as_id_list, read_json

    eos = as_id_list(cfg.outer.get("eos_token_id")) or as_id_list(cfg.get("eos_token_id"))
    generation = os.path.join(cfg.model_dir, "generation_config.json")
    if os.path.isfile(generation):
        eos = as_id_list(read_json(generation).get("eos_token_id")) + eos
    return list(dict.fromkeys(eos))


def hf_common(cfg: HFConfig, arch: str) -> dict[str, Any]:
    """The `ModelConfig` fields every family reads the same way from `config.json`."""
    from sglite.runtime.model.hf_loader import tied_embeddings

    hidden = int(cfg.need("hidden_size"))
    heads = int(cfg.need("num_attention_heads"))
    theta, scaling = rope_from_hf(cfg)
    return dict(
        arch=arch,
        vocab_size=int(cfg.need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(cfg.need("intermediate_size")),
        num_layers=int(cfg.need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim", hidden // heads)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=tied_embeddings(cfg.outer, cfg.raw, cfg.model_dir),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=hf_eos_ids(cfg),
    )


def hf_layer_windows(cfg: HFConfig) -> tuple[int | None, list[int] | None]:
    """(window, its layers) from `sliding_window` and `layer_types` (None: every layer)."""
    window = cfg.get("sliding_window")
    if window is None:
        return None, None
    types = cfg.get("layer_types")
    if types is None:
        return int(window), None
    return int(window), [i for i, t in enumerate(types) if t == "sliding_attention"]


def gguf_common(meta: GGUFConfig, arch: str) -> dict[str, Any]:
    """The `ModelConfig` fields every family reads the same way from GGUF metadata."""
    gf = meta.gf
    hidden = int(meta.need("embedding_length"))
    heads = int(meta.need("attention.head_count"))
    head_dim = int(meta.get("attention.key_length", hidden // heads))
    rope_dim = int(meta.get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"{meta.path}: partial rotary embeddings ({rope_dim}/{head_dim}) are unsupported"
        )
    names = {t.name for t in gf.tensors}
    vocab = meta.get("vocab_size")
    if vocab is None:
        embd = next((t for t in gf.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ValueError(f"{meta.path}: no token_embd.weight tensor")
        vocab = int(embd.shape[-1])  # ggml order: [hidden, vocab]
    eos = [gf.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return dict(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta.need("feed_forward_length")),
        num_layers=int(meta.need("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(meta),
        max_position_embeddings=int(meta.get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        o_proj_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_down.bias" in names,
        bos_token_id=gf.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(e) for e in dict.fromkeys(eos) if e is not None],
        **gguf_experts(meta),
    )


def gguf_experts(meta: GGUFConfig) -> dict[str, Any]:
    """Mixture-of-experts fields (`expert_count` and kin; absent for dense models)."""
    experts = int(meta.get("expert_count", 0))
    if not experts:
        return {}
    routed = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")  # the layers with a router
    layers = sorted(int(m.group(1)) for t in meta.gf.tensors if (m := routed.match(t.name)))
    return dict(
        moe_layers=layers,
        num_experts=experts,
        # llama.cpp renormalizes the chosen experts' weights unless the file says otherwise.
        norm_topk_prob=bool(meta.get("expert_weights_norm", True)),
        num_experts_per_tok=int(meta.need("expert_used_count")),
        moe_intermediate_size=int(
            meta.get("expert_feed_forward_length", meta.need("feed_forward_length"))
        ),
    )


def gguf_rope_scaling(meta: GGUFConfig) -> dict[str, Any] | None:
    """RoPE scaling from GGUF: Llama 3.1's per-frequency divisors (a `rope_freqs` tensor) or
    linear scaling."""
    import numpy as np

    freqs = next((t for t in meta.gf.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return {"rope_type": "freq_factors", "factors": np.asarray(freqs.data).tolist()}
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.need("rope.scaling.factor"))}
    raise ValueError(f"{meta.path}: unsupported GGUF rope scaling type {kind!r}")


# ------------------------------------------------------------------------- checkpoint names


def rename_parts(name: str, renames: Mapping[str, str]) -> str:
    """`name` with each dotted component replaced by `renames` (all at once, so two renames may
    swap names)."""
    return ".".join(renames.get(part, part) for part in name.split("."))


def split_fused(name: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Checkpoints that store q/k/v or gate/up stacked (Phi-3), or every expert in one 3D
    tensor (transformers >= 5, GGUF), as the canonical per-projection tensors."""
    if tensor.dim() == 3 and not name.endswith((".weight", ".bias")):
        name += ".weight"  # transformers' fused experts are parameters of the experts module
    owner, _, rest = name.rpartition(".")
    module, _, last = owner.rpartition(".")
    if last == "qkv_proj":
        sizes = [config.q_size, config.kv_size, config.kv_size]
        for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes), strict=True):
            yield f"{module}.{part}.{rest}", piece
    elif last == "gate_up_proj" and tensor.dim() < 3:
        for part, piece in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
            yield f"{module}.{part}.{rest}", piece
    elif module.endswith("experts") and tensor.dim() == 3:
        if last == "gate_up_proj":
            for e, expert in enumerate(tensor):
                gate, up = expert.chunk(2)
                yield f"{module}.{e}.gate_proj.weight", gate
                yield f"{module}.{e}.up_proj.weight", up
        else:  # gate_proj, up_proj, down_proj: [experts, out, in]
            for e, expert in enumerate(tensor):
                yield f"{module}.{e}.{last}.weight", expert
    else:
        yield name, tensor


def offset_norms(weights: Weights, offset: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Add `offset` to every norm scale (Gemma's checkpoints store `scale - 1`)."""
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = tensor.float() + offset
        yield name, tensor


@dataclass(frozen=True)
class ModelFamily:
    """One family of models (see the module docstring).

    `hf_renames` maps checkpoint name components to canonical ones; `hf_prefixes` are stripped
    (multimodal wrappers' `language_model.`), and names starting with `hf_skipped` are dropped
    (their vision towers). `norm_offset` is added to the norm scales of Hugging Face checkpoints
    (GGUF converters add it already). `gguf_renames` does the same as `hf_renames` for the names
    the GGUF loader derives. `chat_template` and `stop_tokens` (token texts) apply where the
    model's own files have none.
    """

    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    config_from_hf: Callable[[HFConfig, str], ModelConfig]
    gguf_architectures: tuple[str, ...] = ()
    config_from_gguf: Callable[[GGUFConfig, str], ModelConfig] | None = None
    hf_renames: Mapping[str, str] = field(default_factory=dict)
    hf_prefixes: tuple[str, ...] = ()
    hf_skipped: tuple[str, ...] = ()
    norm_offset: float = 0.0
    gguf_renames: Mapping[str, str] = field(default_factory=dict)
    gguf_permuted_qk: bool = False
    chat_template: str | None = None
    stop_tokens: tuple[str, ...] = ()

    def hf_weights(self, weights: Weights, config: ModelConfig) -> Iterator[tuple[str, Any]]:
        """A Hugging Face checkpoint's tensors under canonical names."""
        if self.norm_offset:
            weights = offset_norms(weights, self.norm_offset)
        for name, tensor in weights:
            for prefix in self.hf_prefixes:
                if name.startswith(prefix):
                    name = name.removeprefix(prefix)
                    # The wrapped model's output projection (`language_model.lm_head`) is ours.
                    if not name.startswith("lm_head."):
                        name = "model." + name.removeprefix("model.")
            if self.hf_skipped and name.startswith(self.hf_skipped):
                continue
            yield from split_fused(rename_parts(name, self.hf_renames), tensor, config)

    def gguf_weights(self, weights: Weights, config: ModelConfig) -> Iterator[tuple[str, Any]]:
        """A GGUF file's tensors (named by the GGUF loader) under canonical names."""
        for name, tensor in weights:
            yield from split_fused(rename_parts(name, self.gguf_renames), tensor, config)
