"""Hugging Face model directories: `config.json`, `*.safetensors` (single or sharded), tokenizer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models.base import HFConfig, ModelFamily
from sglite.runtime.model.tokenizer_files import read_json

_INDEX_FILE = "model.safetensors.index.json"


def hf_config(model_dir: str) -> tuple[ModelFamily, ModelConfig]:
    """The family and `ModelConfig` of a directory's `config.json`."""
    from sglite.runtime.model import models

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    raw = read_json(path)
    archs = raw.get("architectures") or [None]
    family = models.family_for_hf(archs[0], raw.get("model_type"))
    if family is None:
        shown = archs[0] or raw.get("model_type")
        supported = ", ".join(models.supported_hf_architectures())
        raise ValueError(f"unsupported architecture {shown!r} in {path}; supported: {supported}")
    arch = archs[0] or family.hf_architectures[0]
    try:
        return family, family.config_from_hf(HFConfig(raw, path), arch)
    except (TypeError, KeyError) as exc:
        raise ValueError(f"{path}: malformed config ({exc})") from exc


def tied_embeddings(outer: dict[str, Any], raw: dict[str, Any], model_dir: str) -> bool:
    """Whether the output projection is the embedding matrix."""
    for cfg in (raw, outer):
        if "tie_word_embeddings" in cfg:
            return bool(cfg["tie_word_embeddings"])
    # Absent key (defaults differ across transformers versions): a checkpoint without an output
    # projection must be tied.
    return not _has_lm_head(model_dir)


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a directory: those named by the shard index, else all `*.safetensors`."""
    index = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map") or {}
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
        return set((read_json(index).get("weight_map") or {}).keys())
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
