"""A model's tokenizer from its files alone: a GGUF's embedded tokenizer (converted by
transformers once and cached on disk by file identity) or a Hugging Face directory's. Nothing
here imports torch: the HTTP server's process loads its tokenizer this way and takes the served
model's stop tokens and chat template from the scheduler (`loader.load_tokenizer` adds them
from the model's family where the files lack them)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

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


def load_tokenizer_files(path: str) -> Tokenizer:
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
    return Tokenizer(hf, config_eos_ids(path))


def _cache_root() -> Path:
    return sglite_cache_dir() / "tokenizers"


def _cache_key(path: str) -> str:
    import transformers

    return file_cache_key(path, transformers.__version__)


def load_gguf_tokenizer(path: str, gf: GGUFFile | None = None) -> Tokenizer:
    """The tokenizer (and chat template) embedded in a GGUF file.

    Converting it takes transformers several seconds (tens for a 150k-token vocabulary), so
    the converted tokenizer is cached on disk (under `$SGLITE_CACHE_DIR`, default
    `~/.cache/sglite`), keyed by file identity, and always read back from there as a
    `PreTrainedTokenizerFast` over its `tokenizer.json`: the same object on every start, and
    no torch import (AutoTokenizer's model-specific classes import transformers' model
    configuration, which imports torch).
    """
    cache_dir = _cache_root() / _cache_key(path)
    meta_file = cache_dir / "sglite_meta.json"
    if meta_file.is_file():
        try:
            return _cached_tokenizer(cache_dir, meta_file)
        except Exception as exc:  # a damaged cache entry: rebuild it
            logger.warning("rebuilding unreadable tokenizer cache %s: %s", cache_dir, exc)
            shutil.rmtree(cache_dir, ignore_errors=True)
    from transformers import AutoTokenizer

    if gf is None:
        gf = open_gguf(path)
    eos = [gf.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = [int(e) for e in dict.fromkeys(eos) if e is not None]
    hf = AutoTokenizer.from_pretrained(
        os.path.dirname(path) or ".", gguf_file=os.path.basename(path)
    )
    if _store_cache(cache_dir, hf, {"eos_token_ids": eos_ids, "source": os.path.realpath(path)}):
        return _cached_tokenizer(cache_dir, meta_file)
    return Tokenizer(hf, eos_ids)  # the cache could not be written (a read-only home)


def _cached_tokenizer(cache_dir: Path, meta_file: Path) -> Tokenizer:
    from transformers import PreTrainedTokenizerFast

    meta = json.loads(meta_file.read_text())
    return Tokenizer(PreTrainedTokenizerFast.from_pretrained(str(cache_dir)), meta["eos_token_ids"])


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
