"""The disk tier: KV pages in files, content-addressed by a hash chain over token ids.

A page holds the K/V (all layers) of `page_size` consecutive tokens at absolute positions
`[k * page_size, (k + 1) * page_size)` of a sequence. Its name is a chain hash:

    h_0 = H(model_key, tokens[0:P]),  h_k = H(h_{k-1}, tokens[kP:(k+1)P])

so a page names the model and the whole prefix it ends, not just its own tokens: the same
prefix always maps to the same file, and a different model never produces (or finds) the same
name. Pages live under `<root>/<model_key>/`, so models do not even share a directory.

File format (one file per page, written to a temporary name and renamed into place, so a reader
sees a whole page or none):

    b"SGLKVPG1" | u32 header length | header (JSON) | payload | sha256(header + payload)

The header repeats the model key, the page hash and the page's token ids; the payload is the
raw K and V tensors `[2, layers, page_size, kv_heads, head_dim]` in the pool dtype. A page whose
magic, header, tokens or checksum do not match is deleted and reported as corrupt, and the
caller recomputes it: a damaged file can cost time, never a wrong answer.

Invariants:
- `self._pages` is exactly the set of page files this process has seen on disk (scanned at start,
  updated on every write and discard).
- A page file is immutable once renamed into place.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAGIC = b"SGLKVPG1"
SUFFIX = ".page"
_DIGEST = 32


@dataclass
class DiskStats:
    """Cumulative counters of the disk tier."""

    pages_written: int = 0
    pages_read: int = 0
    corrupt_pages: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class DiskKVStore:
    """Page files of one model under `<root>/<model_key>/` (see the module docstring)."""

    def __init__(
        self,
        root: str,
        model_key: str,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        model_description: dict | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"hicache_page_size must be >= 1, got {page_size}")
        self.model_key = model_key
        self.page_size = page_size
        self.dtype = dtype
        self.shape = (2, num_layers, page_size, num_kv_heads, head_dim)
        self.dir = os.path.join(os.path.abspath(root), model_key)
        os.makedirs(self.dir, exist_ok=True)
        self._write_description(model_description or {})
        self.stats = DiskStats()
        self._tmp_ids = itertools.count()
        self._pages: dict[str, int] = {}  # page hash -> file size
        self._scan()

    # ------------------------------------------------------------------ naming
    def page_hashes(self, ids: Sequence[int]) -> list[str]:
        """Chain hashes of every full page of `ids` (a trailing partial page has none)."""
        out: list[str] = []
        prev = self.model_key.encode()
        size = self.page_size
        for start in range(0, len(ids) - size + 1, size):
            tokens = struct.pack(f"<{size}q", *ids[start : start + size])
            prev = hashlib.sha256(prev + tokens).hexdigest().encode()
            out.append(prev.decode())
        return out

    def has(self, page_hash: str) -> bool:
        """Whether a page file with this hash is on disk (as far as this process knows)."""
        return page_hash in self._pages

    @property
    def num_pages(self) -> int:
        """Page files on disk."""
        return len(self._pages)

    @property
    def num_bytes(self) -> int:
        """Bytes of the page files on disk."""
        return sum(self._pages.values())

    def page_nbytes(self) -> int:
        """Payload bytes of one page."""
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    # ------------------------------------------------------------------ read / write
    def write_page(self, page_hash: str, tokens: Sequence[int], kv: torch.Tensor) -> int:
        """Store one page atomically; returns the bytes written (0 if it was already there).

        `kv` is `[2, layers, page_size, kv_heads, head_dim]` (K then V) in the store's dtype.
        """
        if page_hash in self._pages:
            return 0
        if tuple(kv.shape) != self.shape or len(tokens) != self.page_size:
            raise ValueError(f"page shape {tuple(kv.shape)} / {len(tokens)} tokens != {self.shape}")
        header = json.dumps(
            {"model_key": self.model_key, "page": page_hash, "tokens": list(tokens),
             "dtype": str(self.dtype).replace("torch.", ""), "shape": list(self.shape)},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        payload = kv.detach().to(self.dtype).contiguous().cpu().view(torch.uint8).numpy().tobytes()
        digest = hashlib.sha256(header + payload).digest()
        path = self._path(page_hash)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{next(self._tmp_ids)}.tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header)
            f.write(payload)
            f.write(digest)
        os.replace(tmp, path)  # atomic: readers see the old state or the whole page
        size = len(MAGIC) + 4 + len(header) + len(payload) + _DIGEST
        self._pages[page_hash] = size
        self.stats.pages_written += 1
        self.stats.bytes_written += size
        return size

    def read_page(self, page_hash: str, tokens: Sequence[int]) -> torch.Tensor | None:
        """The page's K/V `[2, layers, page_size, kv_heads, head_dim]`, or None when it is
        missing or fails verification (a failed file is deleted and counted as corrupt)."""
        if page_hash not in self._pages:
            return None
        path = self._path(page_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self._forget(page_hash)
            return None
        kv = self._decode(data, page_hash, tokens)
        if kv is None:
            self.discard(page_hash)
            self.stats.corrupt_pages += 1
            return None
        self.stats.pages_read += 1
        self.stats.bytes_read += len(data)
        return kv

    def discard(self, page_hash: str) -> None:
        """Delete a page file (missing files are fine)."""
        try:
            os.remove(self._path(page_hash))
        except FileNotFoundError:
            pass
        self._forget(page_hash)

    def verify_all(self) -> list[str]:
        """Hashes of page files whose checksum or header fails (reads every page; for checks)."""
        bad = []
        for page_hash in list(self._pages):
            try:
                with open(self._path(page_hash), "rb") as f:
                    data = f.read()
            except OSError:
                bad.append(page_hash)
                continue
            if self._decode(data, page_hash, None) is None:
                bad.append(page_hash)
        return bad

    # ------------------------------------------------------------------ internals
    def _decode(
        self, data: bytes, page_hash: str, tokens: Sequence[int] | None
    ) -> torch.Tensor | None:
        """Parse and verify one file's bytes; None on any mismatch."""
        head = len(MAGIC) + 4
        if len(data) < head + _DIGEST or data[: len(MAGIC)] != MAGIC:
            return None
        (header_len,) = struct.unpack("<I", data[len(MAGIC) : head])
        body_end = len(data) - _DIGEST
        if head + header_len > body_end:
            return None
        if hashlib.sha256(data[head:body_end]).digest() != data[body_end:]:
            return None
        try:
            header = json.loads(data[head : head + header_len])
        except ValueError:
            return None
        if (
            header.get("model_key") != self.model_key
            or header.get("page") != page_hash
            or tuple(header.get("shape", ())) != self.shape
            or (tokens is not None and header.get("tokens") != list(tokens))
        ):
            return None
        payload = data[head + header_len : body_end]
        if len(payload) != self.page_nbytes():
            return None
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return raw.view(self.dtype).reshape(self.shape)

    def _path(self, page_hash: str) -> str:
        return os.path.join(self.dir, page_hash[:2], page_hash + SUFFIX)

    def _forget(self, page_hash: str) -> None:
        self._pages.pop(page_hash, None)

    def _scan(self) -> None:
        """Index the page files already on disk (a restart finds the previous run's pages)."""
        for entry in os.scandir(self.dir):
            if not entry.is_dir():
                continue
            for page in os.scandir(entry.path):
                if page.name.endswith(SUFFIX):
                    self._pages[page.name[: -len(SUFFIX)]] = page.stat().st_size
                elif page.name.endswith(".tmp") and _stale(page):
                    # Left by a process killed mid-write (a fresh one may be another server's).
                    try:
                        os.remove(page.path)
                    except OSError:
                        pass

    def _write_description(self, description: dict) -> None:
        """A human-readable note of which model the directory belongs to (never read back)."""
        path = os.path.join(self.dir, "model.json")
        if os.path.exists(path) or not description:
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(description, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def _stale(entry: os.DirEntry, age_seconds: float = 600.0) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > age_seconds
    except OSError:
        return False


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
