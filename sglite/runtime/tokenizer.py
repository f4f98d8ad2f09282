"""A model's tokenizer: the operations the runtime needs, over the Rust `tokenizers` library.

Encoding, decoding and the special tokens go through the model's `tokenizers.Tokenizer` (its
`tokenizer.json`), which loads in a fraction of a second; the transformers tokenizer (`hf`) is
loaded only where something needs it (chat templating, the xgrammar backend, image prompts),
because importing transformers would otherwise be a large part of every start.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers

# The special-token attributes whose ids transformers lists in `all_special_ids`.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# transformers' `clean_up_tokenization` (WordPiece-era spacing before punctuation).
_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")]
_CLEAN_UP += [(" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]


class Tokenizer:
    """Text <-> token ids, stop tokens and chat templating for one model.

    `extra_eos_ids` are stop tokens the tokenizer itself does not name as its eos token (from
    `generation_config.json` or GGUF metadata such as `eot_token_id`). Invariant: `encode`,
    `decode` and `convert_ids_to_tokens` give what the transformers tokenizer `hf` gives.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        chat_template: Any,
        extra_eos_ids: list[int] | tuple[int, ...] = (),
        clean_up_spaces: bool = False,
        hf_loader: Callable[[], Any] | None = None,
        unused_token_ids: tuple[int, ...] = (),
    ) -> None:
        """`special_tokens`: the named ones (`SPECIAL_TOKEN_KEYS`) and any extra ones (other
        keys), as vocabulary strings. `unused_token_ids`: ids the model's file marks as never
        used (a GGUF's padding rows), which constrained decoding never allows."""
        self.backend = backend
        self.unused_token_ids = unused_token_ids
        self.special_tokens = special_tokens
        ids = {key: self.token_to_id(tok) for key, tok in special_tokens.items()}
        self.eos_token_id: int | None = ids.get("eos_token")
        self.bos_token_id: int | None = ids.get("bos_token")
        self.unk_token_id: int | None = ids.get("unk_token")
        self.eos_token_ids: list[int] = []
        for tid in [self.eos_token_id, *extra_eos_ids]:
            if tid is not None and int(tid) not in self.eos_token_ids:
                self.eos_token_ids.append(int(tid))
        named = [ids[key] for key in SPECIAL_TOKEN_KEYS if key in ids]
        extra = [i for key, i in ids.items() if key not in SPECIAL_TOKEN_KEYS]
        self.all_special_ids: list[int] = [i for i in dict.fromkeys(named + extra) if i is not None]
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        if isinstance(chat_template, dict):  # several named templates: use the default one
            chat_template = chat_template.get("default") or next(iter(chat_template.values()), None)
        self.chat_template: str | None = chat_template
        self._clean_up = clean_up_spaces and type(backend.model).__name__ != "BPE"
        self._hf: Any = None
        self._hf_loader = hf_loader
        self._hf_lock = threading.Lock()
        self._hf_thread: threading.Thread | None = None

    @classmethod
    def from_transformers(
        cls, hf: Any, extra_eos_ids: list[int] | tuple[int, ...] = ()
    ) -> Tokenizer:
        """Over a loaded transformers fast tokenizer (its backend and special tokens)."""
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(hf).__name__} is not a fast (tokenizers-backed) tokenizer")
        special = {
            key: str(getattr(hf, key)) for key in SPECIAL_TOKEN_KEYS if getattr(hf, key, None)
        }
        named = set(special.values())
        extra = [t for t in hf.all_special_tokens if t not in named]
        special.update({f"extra_special_token_{i}": str(t) for i, t in enumerate(extra)})
        tok = cls(
            backend,
            special,
            hf.chat_template,
            extra_eos_ids,
            bool(getattr(hf, "clean_up_tokenization_spaces", False)),
        )
        tok._hf = hf
        return tok

    @classmethod
    def from_files(
        cls,
        directory: str | Path,
        extra_eos_ids: list[int] | tuple[int, ...] = (),
        unused_token_ids: tuple[int, ...] = (),
    ) -> Tokenizer:
        """From a directory that transformers' `save_pretrained` wrote (`tokenizer.json`,
        `tokenizer_config.json`, optionally `chat_template.jinja`), without transformers."""
        directory = Path(directory)
        config = _read_json(directory / "tokenizer_config.json")
        special = {key: _token_text(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key)}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        for i, token in enumerate(extra.values() if isinstance(extra, dict) else extra or []):
            special[f"extra_special_token_{i}"] = _token_text(token)
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        return cls(
            backend,
            special,
            template or config.get("chat_template"),
            extra_eos_ids,
            bool(config.get("clean_up_tokenization_spaces", False)),
            hf_loader=lambda: _load_fast_tokenizer(str(directory)),
            unused_token_ids=unused_token_ids,
        )

    @property
    def hf(self) -> Any:
        """The transformers tokenizer over the same files (loaded on first use)."""
        with self._hf_lock:
            if self._hf is None:
                if self._hf_loader is None:
                    raise ValueError("this tokenizer has no transformers counterpart")
                self._hf = self._hf_loader()
            return self._hf

    def load_hf_in_background(self) -> None:
        """Start loading `hf` on a daemon thread (a first `hf` use waits for it); once: later
        calls find it loaded or loading."""
        if self._hf is None and self._hf_loader is not None and self._hf_thread is None:
            self._hf_thread = threading.Thread(target=lambda: self.hf, daemon=True, name="load-hf")
            self._hf_thread.start()

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary string `token`, None if it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS is prepended only if this model's
        tokenizer does so itself."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Text of `ids` (`spaces_between_special_tokens` is accepted for the slow tokenizers'
        signature; fast tokenizers, like this one, ignore it)."""
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def decode_each(self, ids: list[int]) -> list[str]:
        """The text of each id on its own (special tokens as empty text), in one batched call."""
        return self.backend.decode_batch([[int(i)] for i in ids], skip_special_tokens=True)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Vocabulary strings of `ids` (byte-level BPE pieces such as 'Ġworld')."""
        return [self.backend.id_to_token(int(i)) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        """Every vocabulary string (added tokens too) and its id."""
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template (raises ValueError without one)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return self.hf.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )

    def __len__(self) -> int:
        return self.vocab_size


def _token_text(token: Any) -> str:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    return str(token["content"]) if isinstance(token, dict) else str(token)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _load_fast_tokenizer(directory: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory)
