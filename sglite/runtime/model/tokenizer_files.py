"""A model's tokenizer from its files alone: a GGUF's embedded tokenizer (converted by
transformers once and cached on disk by file identity) or a Hugging Face directory's. Nothing
here imports torch: the HTTP server's process loads its tokenizer this way and takes the served
model's stop tokens and chat template from the scheduler (`loader.load_tokenizer` adds them
from the model's family where the files lack them)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sglite.runtime.model.gguf_header import read_header
from sglite.runtime.model.gguf_index import GGUFFile, file_cache_key, open_gguf, sglite_cache_dir
from sglite.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def is_gguf(path: str) -> bool:
    """Whether `path` is a GGUF file (by its name, else its magic bytes)."""
    if os.path.isdir(path):
        return False
    if path.endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def single_gguf_in(path: str) -> str | None:
    """The one .gguf of a directory holding one and no config.json (served as that file)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    ggufs = [n for n in os.listdir(path) if n.endswith(".gguf")]
    return os.path.join(path, ggufs[0]) if len(ggufs) == 1 else None


def load_tokenizer_files(path: str | None) -> Tokenizer:
    """The tokenizer of a model path (a GGUF file, a directory holding one, or a Hugging Face
    directory; names and None resolved by the catalog), without the family's additions."""
    from sglite.runtime.model.catalog import resolve_model_path

    path = resolve_model_path(path)
    path = single_gguf_in(path) or path
    if is_gguf(path):
        return load_gguf_tokenizer(path)
    if os.path.isdir(path):
        return load_hf_tokenizer(path)
    raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory")


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from `path`; ValueError when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def as_id_list(value: Any) -> list[int]:
    """A token id field (absent, one id, or a list) as a list."""
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
                ids += as_id_list(read_json(path).get("eos_token_id"))
            except (ValueError, TypeError):
                continue  # a malformed optional file must not prevent tokenization
    return list(dict.fromkeys(ids))


def load_hf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a Hugging Face directory (chat template from tokenizer_config.json or
    chat_template.jinja), with stop tokens from its generation/model config."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
    return Tokenizer.from_transformers(hf, config_eos_ids(path))


_CACHE_FORMAT = "2"  # bump when sglite_meta.json changes
GGUF_TOKEN_UNUSED = 5  # llama.cpp's token type of a vocabulary's padding rows


def _cache_root() -> Path:
    return sglite_cache_dir() / "tokenizers"


def _cache_key(path: str) -> str:
    from importlib.metadata import version

    # The version from the package metadata: importing transformers would slow every start.
    return file_cache_key(path, version("transformers"), _CACHE_FORMAT)


def cached_gguf_tokenizer(path: str) -> Tokenizer | None:
    """The GGUF's tokenizer from the cache, None where it is not there (or unreadable)."""
    cache_dir = _cache_root() / _cache_key(path)
    meta_file = cache_dir / "sglite_meta.json"
    if not meta_file.is_file():
        return None
    try:
        return _cached_tokenizer(cache_dir, meta_file)
    except Exception as exc:  # a damaged entry: load_gguf_tokenizer rebuilds it
        logger.warning("unreadable tokenizer cache %s: %s", cache_dir, exc)
        return None


def load_gguf_tokenizer(path: str, gf: GGUFFile | None = None) -> Tokenizer:
    """The tokenizer (and chat template) embedded in a GGUF file.

    Converting it takes transformers a second or more (`convert_gguf_tokenizer`), so the
    converted tokenizer is cached on disk (under `$SGLITE_CACHE_DIR`, default
    `~/.cache/sglite`), keyed by file identity, and always read back from there by
    `Tokenizer.from_files`: the same tokenizer on every start, without importing transformers.
    One process converts at a time (a lock file beside the entry): the server's HTTP process
    and its scheduler both ask on a first start, and the second one reads the first's result.
    """
    cached = cached_gguf_tokenizer(path)
    if cached is not None:
        return cached
    cache_dir = _cache_root() / _cache_key(path)
    with _conversion_lock(cache_dir):
        cached = cached_gguf_tokenizer(path)  # converted while this process waited
        if cached is not None:
            return cached
        return _convert_and_store(path, gf or open_gguf(path), cache_dir)


def _convert_and_store(path: str, gf: GGUFFile, cache_dir: Path) -> Tokenizer:
    shutil.rmtree(cache_dir, ignore_errors=True)  # a damaged entry, if any: rebuilt
    eos = [gf.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = [int(e) for e in dict.fromkeys(eos) if e is not None]
    hf = convert_gguf_tokenizer(path, gf)
    types = read_header(path, keep_keys=["tokenizer.ggml.token_type"]).metadata
    token_types = types.get("tokenizer.ggml.token_type", [])
    unused = [i for i, t in enumerate(token_types) if t == GGUF_TOKEN_UNUSED]
    meta = {"eos_token_ids": eos_ids, "unused_token_ids": unused, "source": os.path.realpath(path)}
    if _store_cache(cache_dir, hf, meta):
        return _cached_tokenizer(cache_dir, cache_dir / "sglite_meta.json")
    return Tokenizer.from_transformers(hf, eos_ids)  # the cache could not be written


@contextlib.contextmanager
def _conversion_lock(cache_dir: Path) -> Iterator[None]:
    """Held while one process converts the tokenizer of `cache_dir`'s entry; a process that
    cannot create the lock file (a read-only cache) converts without it."""
    try:
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir.with_name(cache_dir.name + ".lock"), "a+")  # noqa: SIM115
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        yield


# llama.cpp's architecture names that transformers' GGUF loader renames to its model type.
_GGUF_MODEL_TYPES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}


# The tokenizer class AutoTokenizer picks for the model types of the GGUF architectures sglite
# serves (transformers' TOKENIZER_MAPPING_NAMES; None: it names none, TokenizersBackend is
# used). Looking one up in transformers imports torch, a second and a half of a first start that
# converts the tokenizer beside the scheduler's own torch import; other model types take that
# path. A test holds this table equal to transformers' and covering every served architecture.
GGUF_TOKENIZER_CLASSES: dict[str, str | None] = {
    "llama": None,
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
    "gemma3": "GemmaTokenizer",
    "phi3": "TokenizersBackend",
}


def gguf_tokenizer_class_name(gf: GGUFFile) -> str | None:
    """The transformers tokenizer class `AutoTokenizer` picks for this GGUF (by the model type
    its architecture maps to; `TokenizersBackend` where transformers names none), or None where
    the choice depends on more than the architecture (Mistral and T5 files)."""
    arch = str(gf.field("general.architecture") or "")
    name = str(gf.field("general.name") or "").lower()
    if not arch or "t5" in arch or ("llama" in arch and "mistral" in name):
        return None
    model_type = _GGUF_MODEL_TYPES.get(arch, arch)
    if model_type in GGUF_TOKENIZER_CLASSES:
        return GGUF_TOKENIZER_CLASSES[model_type] or "TokenizersBackend"
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    return TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend"


def _tokenizer_class(class_name: str) -> Any:
    """The transformers tokenizer class named `class_name` (None where there is none), through
    transformers' lazy top-level names, which import only that class's module."""
    import transformers

    return getattr(transformers, class_name, None)


def convert_gguf_tokenizer(path: str, gf: GGUFFile) -> Any:
    """transformers' tokenizer for the GGUF at `path`, as `AutoTokenizer.from_pretrained(...,
    gguf_file=...)` builds it: the class AutoTokenizer picks, over the tokenizer transformers'
    GGUF converter builds from the file's vocabulary. AutoTokenizer itself would import torch
    and walk every metadata array in Python twice (gguf's reader for the model config, which
    only names the class, then its own reader, each making a Python object per vocabulary entry
    and merge); here the served architectures' classes are found without importing torch and
    the vocabulary is read with `gguf_header`.
    """
    directory, name = os.path.dirname(path) or ".", os.path.basename(path)
    class_name = gguf_tokenizer_class_name(gf)
    cls = _tokenizer_class(class_name) if class_name else None
    if cls is None or os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, gguf_file=name)  # the general path
    backend, config = _converted_backend(path)
    return cls(tokenizer_object=backend, **config)


def _converted_backend(path: str) -> tuple[Any, dict[str, Any]]:
    """transformers' GGUF tokenizer conversion (`tokenizers` backend, tokenizer config) fed
    with the file's tokenizer metadata, as its `get_gguf_tokenizer` arranges it."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    long = ("tokens", "merges", "token_type", "scores", "precompiled_charsmap")
    metadata = read_header(path, keep_keys=[f"tokenizer.ggml.{k}" for k in long]).metadata
    grouped = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to such vocabularies
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    return backend, {**config, **extra}


def _cached_tokenizer(cache_dir: Path, meta_file: Path) -> Tokenizer:
    meta = json.loads(meta_file.read_text())
    unused = tuple(meta["unused_token_ids"])
    return Tokenizer.from_files(cache_dir, meta["eos_token_ids"], unused)


def _store_cache(cache_dir: Path, hf: Any, meta: dict[str, Any]) -> bool:
    """Write the converted tokenizer into the cache; False where it cannot be written."""
    try:
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir.parent, prefix=".tmp-"))
        hf.save_pretrained(str(tmp))
        (tmp / "sglite_meta.json").write_text(json.dumps(meta))
        try:
            os.replace(tmp, cache_dir)  # atomic: readers never see a half-written entry
        except OSError:  # another process stored it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:  # a read-only home is not an error, just slower start-ups
        logger.debug("not caching tokenizer: %s", exc)
        return False
    return True
