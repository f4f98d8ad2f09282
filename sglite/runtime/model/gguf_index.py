"""A GGUF file's metadata and tensor table: parsed once with `gguf`, then read from a cache.

Why: `gguf.GGUFReader` parses every metadata item, and a model's vocabulary and merges are
~100k of them: about 2.2 s of a 7 s server start for the default model, at every start. The
loader needs only the small metadata (scalars, strings, short arrays) and where each tensor lies,
so those are stored as JSON (`$SGLITE_CACHE_DIR/gguf/<key>.json`, default `~/.cache/sglite`),
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

logger = logging.getLogger(__name__)

# Metadata arrays longer than this (vocabulary, merges, token scores) are not kept: the loader
# never reads them, and the tokenizer is converted by transformers from the file itself.
MAX_KEPT_ARRAY = 1024
_FORMAT = 1  # bump when the entry layout changes


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

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (python scalar, str or list), or `default` when absent."""
        return self.metadata.get(key, default)


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


def _fast_reader_class() -> type:
    """`gguf.GGUFReader` whose file map is a plain ndarray view of its `np.memmap`.

    Why: the reader slices its map once per metadata item, and the vocabulary and merges are
    ~100k items; every slice of an `np.memmap` runs memmap's Python-level `__getitem__` and
    `__array_finalize__`, half of the reader's time (~1.5 s of 3 for the default model). A
    plain view slices in C, still reads the same mapped pages, and keeps the map alive."""
    import gguf
    import numpy as np

    class FastGGUFReader(gguf.GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain_data

        @data.setter
        def data(self, value: Any) -> None:
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return FastGGUFReader


def read_gguf(path: str) -> Any:
    """Open a GGUF file; raises ValueError when it is not a valid (complete) GGUF file."""
    try:
        reader = _fast_reader_class()(path)
    except Exception as exc:  # the reader raises many types on garbage input
        raise ValueError(f"{path} is not a valid GGUF file: {exc}") from exc
    for tensor in reader.tensors:
        # A truncated file maps shorter arrays instead of failing at open time.
        if tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(
                f"{path} is not a valid GGUF file: tensor {tensor.name} is truncated "
                f"({tensor.data.nbytes} of {tensor.n_bytes} bytes)"
            )
    return reader


def _parse(path: str) -> tuple[GGUFFile, dict[str, Any]]:
    """Parse with gguf's reader; returns the file and its cache record."""
    import gguf

    reader = read_gguf(path)
    metadata = {}
    for key, item in reader.fields.items():
        if item.types and item.types[0] == gguf.GGUFValueType.ARRAY:
            if len(item.data) > MAX_KEPT_ARRAY:
                continue
        metadata[key] = _value(item)
    tensors, rows = [], []
    for t in reader.tensors:
        shape = tuple(int(d) for d in t.shape)
        tensors.append(GGUFTensor(t.name, t.tensor_type, shape, int(t.n_bytes), t.data))
        rows.append(
            {
                "name": t.name,
                "type": int(t.tensor_type),
                "shape": shape,
                "n_bytes": int(t.n_bytes),
                "offset": int(t.data_offset),
                "dtype": t.data.dtype.str,
                "data_shape": list(t.data.shape),
            }
        )
    record = {"size": os.path.getsize(path), "metadata": metadata, "tensors": rows}
    return GGUFFile(path, metadata, tensors), record


def _value(item: Any) -> Any:
    """A reader field as a python scalar, str or list."""
    import gguf

    as_str = lambda part: bytes(part).decode("utf-8")  # noqa: E731
    kind = item.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if item.types[-1] == gguf.GGUFValueType.STRING:
            return [as_str(item.parts[i]) for i in item.data]
        return [v for i in item.data for v in item.parts[i].tolist()]
    if kind == gguf.GGUFValueType.STRING:
        return as_str(item.parts[-1])
    return item.parts[-1].tolist()[0]


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
    return GGUFFile(path, record["metadata"], tensors)


def _store(entry: Path, record: dict[str, Any]) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, entry)  # atomic: readers never see a half-written entry
    except OSError as exc:  # a read-only home is not an error, just slower start-ups
        logger.debug("not caching the GGUF index: %s", exc)
