"""A GGUF file's metadata and tensor table: read once from its header (`gguf_header`), then
from a cache.

The loader needs only the small metadata (scalars, strings, short arrays) and where each tensor
lies, so those are stored as JSON (`$SGLITE_CACHE_DIR/gguf/<key>.json`, default `~/.cache/sglite`),
keyed by the file's real path, size and modification time and by gguf's version; later opens
map the file and take the table from there.

Invariants: `GGUFFile.tensors[i].data` has the dtype, shape and bytes of gguf's
`ReaderTensor.data` and is a read-only view of the mapped file (never a copy); a cache entry is
used only for the exact file it was made from, and an unreadable one is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from sglite.runtime.model.gguf_header import read_header

logger = logging.getLogger(__name__)

# Metadata arrays longer than this (vocabulary, merges, token scores) are not kept: the loader
# never reads them, and the tokenizer is converted by transformers from the file itself.
MAX_KEPT_ARRAY = 1024
_FORMAT = 2  # bump when the entry layout changes

# ggml types gguf's reader maps as values (the rest as bytes), by their ggml type number.
_VALUE_DTYPES = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


def sglite_cache_dir() -> Path:
    """`$SGLITE_CACHE_DIR`, else `$XDG_CACHE_HOME/sglite`, else `~/.cache/sglite`."""
    root = os.environ.get("SGLITE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sglite"
    )
    return Path(root)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, as gguf's reader describes it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    n_bytes: int
    data: np.ndarray  # read-only view of the mapped file (quantized types: raw bytes per row)


@dataclass
class GGUFFile:
    """The metadata the loader reads and every tensor of one GGUF file."""

    path: str
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[GGUFTensor] = field(default_factory=list)
    mapping_address: int = 0  # where the tensors' mapping of the file starts
    mapping_size: int = 0

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (python scalar, str or list), or `default` when absent."""
        return self.metadata.get(key, default)

    def file_offset(self, array: np.ndarray) -> int | None:
        """The file offset of `array` when it is a C-contiguous view of this file's mapping
        (a tensor's data or rows of it), else None."""
        if not array.flags.c_contiguous:
            return None
        address = array.ctypes.data
        end = self.mapping_address + self.mapping_size
        if self.mapping_address <= address and address + array.nbytes <= end:
            return address - self.mapping_address
        return None


def open_gguf(path: str) -> GGUFFile:
    """Open a GGUF file, from the cache when it has this file's table.

    Raises ValueError when the file is not a valid (complete) GGUF file.
    """
    entry = _entry_path(path)
    if entry is not None and entry.is_file():
        try:
            return _from_entry(path, json.loads(entry.read_text()))
        except Exception as exc:  # damaged or stale: parse the file again
            logger.warning("rebuilding unreadable GGUF index %s: %s", entry, exc)
    parsed, record = _parse(path)
    if entry is not None:
        _store(entry, record)
    return parsed


def file_cache_key(path: str, *versions: str) -> str:
    """A key for caches derived from the file at `path`: its real path, size and modification
    time, and the `versions` of what derived them. Raises OSError when the file is missing."""
    st = os.stat(path)
    ident = "|".join([os.path.realpath(path), str(st.st_size), str(st.st_mtime_ns), *versions])
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def _entry_path(path: str) -> Path | None:
    try:
        key = file_cache_key(path, version("gguf"), str(_FORMAT))
    except OSError:
        return None
    return sglite_cache_dir() / "gguf" / f"{key}.json"


def _parse(path: str) -> tuple[GGUFFile, dict[str, Any]]:
    """Read the file's header (`gguf_header`); returns the file and its cache record."""
    header = read_header(path, keep_arrays=MAX_KEPT_ARRAY)
    size = os.path.getsize(path)
    rows = []
    for t in header.tensors:
        dtype, data_shape, n_bytes = _data_layout(t.dims, t.ggml_type)
        if t.offset + n_bytes > size:
            raise ValueError(
                f"{path} is not a valid GGUF file: tensor {t.name} is truncated "
                f"({max(0, size - t.offset)} of {n_bytes} bytes)"
            )
        rows.append(
            {
                "name": t.name,
                "type": t.ggml_type,
                "shape": list(t.dims),
                "n_bytes": n_bytes,
                "offset": t.offset,
                "dtype": dtype.str,
                "data_shape": list(data_shape),
            }
        )
    record = {"size": size, "metadata": header.metadata, "tensors": rows}
    return _from_entry(path, record), record


def _data_layout(dims: tuple[int, ...], ggml_type: int) -> tuple[np.dtype, tuple[int, ...], int]:
    """The numpy dtype and shape gguf's reader gives a tensor's data, and its byte count:
    float and integer types as their values (rows outermost), every other type as rows of
    bytes."""
    import gguf

    kind = gguf.GGMLQuantizationType(ggml_type)
    shape = tuple(reversed(dims))
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    n_bytes = n_elements * type_size // block_size
    if kind in _VALUE_DTYPES:
        return np.dtype(_VALUE_DTYPES[kind]), shape, n_bytes
    return np.dtype(np.uint8), gguf.quant_shape_to_byte_shape(shape, kind), n_bytes


def _from_entry(path: str, record: dict[str, Any]) -> GGUFFile:
    import gguf

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != record["size"]:
            raise ValueError("the file's size changed")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tensors = []
    for row in record["tensors"]:
        dtype = np.dtype(row["dtype"])
        data = np.ndarray(tuple(row["data_shape"]), dtype, buffer, offset=row["offset"])
        kind = gguf.GGMLQuantizationType(row["type"])
        tensors.append(GGUFTensor(row["name"], kind, tuple(row["shape"]), row["n_bytes"], data))
    address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    return GGUFFile(path, record["metadata"], tensors, address, len(buffer))


def _store(entry: Path, record: dict[str, Any]) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, entry)  # atomic: readers never see a half-written entry
    except OSError as exc:  # a read-only home is not an error, just slower start-ups
        logger.debug("not caching the GGUF index: %s", exc)
