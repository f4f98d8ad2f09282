"""The identity of a model's KV cache: what must match for a stored KV page to be reused.

KV entries depend on the weights, the architecture, the dtype the model runs in, the device kind
and weight quantization (decode matmuls read the quantized copy), and on sglite's own KV layout.
The key hashes all of them; the weights enter through a content hash of the model's files, so a
renamed copy of the same file shares pages and an edited file never does.

Hashing a multi-gigabyte file takes seconds, so the content hash is remembered in
`<hicache_dir>/fingerprints.json` under the file's (path, size, mtime): a change of any of them
hashes the file again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import sglite

# Bump when the page payload layout or the meaning of a KV entry changes.
KV_FORMAT_VERSION = 1
_CHUNK = 8 << 20
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")


def model_files(model_path: str) -> list[str]:
    """The files whose bytes decide the model's KV: the file itself, or a directory's config
    and weight files (the tokenizer does not matter: pages are keyed by token ids)."""
    if os.path.isfile(model_path):
        return [os.path.abspath(model_path)]
    names = sorted(os.listdir(model_path))
    picked = [n for n in names if n == "config.json" or n.endswith(_WEIGHT_SUFFIXES)]
    if not picked:
        raise ValueError(f"hicache_dir: no config or weight files found in {model_path}")
    return [os.path.abspath(os.path.join(model_path, n)) for n in picked]


def file_digest(path: str, memo_path: str | None = None) -> str:
    """sha256 of a file's bytes, remembered in `memo_path` by (path, size, mtime_ns)."""
    st = os.stat(path)
    memo_key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    memo = _read_memo(memo_path)
    if memo_key in memo:
        return memo[memo_key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    if memo_path is not None:
        memo[memo_key] = value
        _write_memo(memo_path, memo)
    return value


def model_key(
    model_path: str,
    config: Any,
    dtype: str,
    device_type: str,
    quantization: str,
    quantized_max_rows: int,
    memo_path: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """(key, description): a 32-hex-digit key naming the model's KV and what it was built from."""
    paths = model_files(model_path)
    # A single file is named by its content only, so a renamed copy shares the key.
    names = ["weights"] if os.path.isfile(model_path) else [os.path.basename(p) for p in paths]
    files = {name: file_digest(p, memo_path) for name, p in zip(names, paths)}
    config_dict = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    description = {
        "kv_format": KV_FORMAT_VERSION,
        "sglite": sglite.__version__,
        "files": files,
        "config": config_dict,
        "dtype": dtype,
        "device": device_type,
        "quantization": quantization,
        "quantized_max_rows": quantized_max_rows if quantization != "none" else None,
    }
    blob = json.dumps(description, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32], {"model_path": model_path, **description}


def _read_memo(path: str | None) -> dict[str, str]:
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # a damaged memo only costs a re-hash
        return {}


def _write_memo(path: str, memo: dict[str, str]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(memo, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
