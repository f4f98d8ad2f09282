"""Hugging Face model directories: `config.json`, `*.safetensors` (single or sharded), tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from sglite.runtime.model.config import SUPPORTED_ARCHS, ModelConfig
from sglite.runtime.tokenizer import Tokenizer

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def config_eos_ids(model_dir: str) -> list[int]:
    """Stop token ids named by `generation_config.json` and `config.json` (either may be absent)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            try:
                ids += _as_id_list(_read_json(path).get("eos_token_id"))
            except (ValueError, TypeError):
                continue  # a malformed optional file must not prevent tokenization
    return list(dict.fromkeys(ids))


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters` (theta included); older files use
    # `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    if params and "rope_theta" not in params and "rope_type" not in params:
        params = dict(params.get("full_attention") or {})  # per-layer-type form
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params or None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        else:
            scaling = {**scaling, "rope_type": kind}
    return theta, scaling


def hf_config(model_dir: str) -> ModelConfig:
    """Build the ModelConfig from a directory's `config.json`."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    cfg = _read_json(path)
    archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), None)]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHS:
        shown = arch or cfg.get("model_type")
        raise ValueError(
            f"unsupported architecture {shown!r} in {path}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope_params(cfg)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    llama_bias = arch == "LlamaForCausalLM" and bool(cfg.get("attention_bias", False))
    window, window_layers = _sliding_window(cfg, arch)
    generation = os.path.join(model_dir, "generation_config.json")
    eos = _as_id_list(cfg.get("eos_token_id"))
    if os.path.isfile(generation):
        eos = _as_id_list(_read_json(generation).get("eos_token_id")) + eos
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=_tied(cfg, model_dir),
        attention_bias=is_qwen2 or llama_bias,
        o_proj_bias=llama_bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        sliding_window=window,
        sliding_window_layers=window_layers,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
    )


def _tied(cfg: dict[str, Any], model_dir: str) -> bool:
    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    # Absent key (defaults differ across transformers versions): a checkpoint without an output
    # projection must be tied.
    return not _has_lm_head(model_dir)


def _sliding_window(cfg: dict[str, Any], arch: str) -> tuple[int | None, list[int] | None]:
    window = cfg.get("sliding_window")
    if window is None:
        return None, None
    if arch == "Qwen2ForCausalLM":
        # Qwen2 only uses its window when asked to, and then only from max_window_layers up.
        if not cfg.get("use_sliding_window", False):
            return None, None
        types = cfg.get("layer_types")
        if types is None:
            start = int(cfg.get("max_window_layers", 0))
            return int(window), list(range(start, int(cfg["num_hidden_layers"])))
        return int(window), [i for i, t in enumerate(types) if t == "sliding_attention"]
    return int(window), None


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a directory: those named by the shard index, else all `*.safetensors`."""
    index = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map") or {}
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    files = [os.path.join(model_dir, n) for n in names]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"weight shard {f} (listed in {_INDEX_FILE}) is missing")
    return files


def _tensor_names(model_dir: str) -> set[str]:
    index = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index):
        return set((_read_json(index).get("weight_map") or {}).keys())
    from safetensors import safe_open

    names: set[str] = set()
    for f in safetensors_files(model_dir):
        try:
            with safe_open(f, framework="pt") as st:
                names.update(st.keys())
        except Exception:
            continue  # reported properly when the weights are read
    return names


def _has_lm_head(model_dir: str) -> bool:
    try:
        return "lm_head.weight" in _tensor_names(model_dir)
    except FileNotFoundError:
        return False


def iter_safetensors_weights(
    files: list[str], progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` from each file; raises ValueError on a corrupt or truncated file."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    bar = tqdm(desc="loading safetensors", unit="tensor", disable=not progress)
    try:
        for path in files:
            try:
                handle = safe_open(path, framework="pt")
            except Exception as exc:  # SafetensorError, OSError on a bad header, ...
                raise ValueError(f"{path} is not a valid safetensors file: {exc}") from exc
            with handle as st:
                keys = list(st.keys())
                bar.total = (bar.total or 0) + len(keys)
                for key in keys:
                    try:
                        tensor = st.get_tensor(key)
                    except Exception as exc:
                        raise ValueError(
                            f"{path} is not a valid safetensors file ({key}: {exc})"
                        ) from exc
                    bar.update(1)
                    yield key, tensor
    finally:
        bar.close()


def load_hf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a Hugging Face directory (chat template from tokenizer_config.json or
    chat_template.jinja), with stop tokens from its generation/model config."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
    return Tokenizer(hf, config_eos_ids(path))
