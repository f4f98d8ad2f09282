"""A GGUF file's header read straight from its bytes: the metadata and the tensor table.

Why not `gguf.GGUFReader`: it builds numpy views for every item of every metadata array, and a
151k-token vocabulary with its merges is ~450k of them, each a Python object. Here a long
array is skipped by walking its lengths (or decoded, when the caller asks for it by key), and
nothing but the header is read.

Layout (GGUF v2/v3, little-endian): magic `GGUF`, version u32, tensor count u64, metadata count
u64; each metadata item is a string key, a u32 value type and the value; each tensor is a
string name, u32 dimension count, u64 dimensions, u32 ggml type and u64 offset into the data
section, which starts at the header's end rounded up to `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

# GGUF value types: struct format of the scalar ones.
_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32


@dataclass
class TensorInfo:
    """One tensor as the header describes it (`dims` in the file's order, fastest first)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the file


@dataclass
class GGUFHeader:
    """The metadata (long arrays only where asked for) and the tensor table of one file."""

    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0


class _Cursor:
    """Reads little-endian values from a buffer, raising ValueError past its end."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buffer):
            raise ValueError("the header ends early (a truncated or damaged file)")
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        return self.raw_string().decode("utf-8")

    def raw_string(self) -> bytes:
        n = self.unpack("Q")
        if self.pos + n > len(self.buffer):
            raise ValueError("the header ends early (a truncated or damaged file)")
        data = bytes(self.buffer[self.pos : self.pos + n])
        self.pos += n
        return data

    def value(self, kind: int, keep: bool) -> Any:
        """A value of GGUF type `kind`; a skipped array (`keep` False) is returned as None."""
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, n = self.unpack("I"), self.unpack("Q")
        if item in _SCALAR:
            size = struct.calcsize(_SCALAR[item])
            if self.pos + n * size > len(self.buffer):
                raise ValueError("the header ends early (a truncated or damaged file)")
            values = None
            if keep:
                fmt = f"<{n}{_SCALAR[item]}"
                values = list(struct.unpack_from(fmt, self.buffer, self.pos))
            self.pos += n * size
            return values
        if item == _STRING:
            return self.strings(n, keep)
        return [self.value(item, keep) for _ in range(n)]

    def strings(self, n: int, keep: bool) -> list[str] | None:
        """`n` strings (None when not `keep`: skipped). One loop over the lengths with locals:
        a vocabulary and its merges are ~300k strings, read on a first start."""
        buffer, pos, end = self.buffer, self.pos, len(self.buffer)
        length_at = _U64.unpack_from
        values: list[str] = []
        for _ in range(n):
            if pos + 8 > end:
                raise ValueError("the header ends early (a truncated or damaged file)")
            (length,) = length_at(buffer, pos)
            pos += 8 + length
            if pos > end:
                raise ValueError("the header ends early (a truncated or damaged file)")
            if keep:
                values.append(buffer[pos - length : pos].decode("utf-8"))
        self.pos = pos
        return values if keep else None


def read_header(path: str, keep_arrays: int = 1024, keep_keys: Collection[str] = ()) -> GGUFHeader:
    """The header of the GGUF at `path`: arrays of at most `keep_arrays` items and those named
    in `keep_keys` are kept, longer ones are left out of `metadata`.

    Raises ValueError when the file is not a (complete, little-endian) GGUF file.
    """
    with open(path, "rb") as f:
        try:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file
            raise ValueError(f"{path} is not a valid GGUF file: {exc}") from None
    try:
        return _parse(buffer, keep_arrays, frozenset(keep_keys))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a valid GGUF file: {exc}") from None
    finally:
        buffer.close()


def _parse(buffer: mmap.mmap, keep_arrays: int, keep_keys: frozenset[str]) -> GGUFHeader:
    cur = _Cursor(buffer)
    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (or a big-endian file)")
    n_tensors, n_items = cur.unpack("Q"), cur.unpack("Q")
    header = GGUFHeader(version)
    for _ in range(n_items):
        key = cur.string()
        kind = cur.unpack("I")
        start = cur.pos
        value = cur.value(kind, keep=True) if kind != _ARRAY else None
        if kind == _ARRAY:
            cur.pos = start
            length = _array_length(cur)
            value = cur.value(kind, keep=length <= keep_arrays or key in keep_keys)
        if value is not None:
            header.metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("Q") for _ in range(cur.unpack("I")))
        infos.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
    alignment = int(header.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    header.data_offset = -(-cur.pos // alignment) * alignment
    header.tensors = [
        TensorInfo(name, dims, kind, header.data_offset + offset)
        for name, dims, kind, offset in infos
    ]
    return header


def _array_length(cur: _Cursor) -> int:
    """The item count of the array at the cursor (the cursor is left where it was)."""
    start = cur.pos
    cur.unpack("I")
    n = cur.unpack("Q")
    cur.pos = start
    return int(n)
