"""A thin wrapper over a transformers tokenizer with the few operations the runtime needs."""

from __future__ import annotations

from typing import Any


class Tokenizer:
    """Text <-> token ids, stop tokens and chat templating for one model.

    `extra_eos_ids` are stop tokens the tokenizer itself does not name as its eos token (from
    `generation_config.json` or GGUF metadata such as `eot_token_id`).
    """

    def __init__(self, hf: Any, extra_eos_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.hf = hf
        ids: list[int] = []
        for tid in [hf.eos_token_id, *extra_eos_ids]:
            if tid is not None and tid not in ids:
                ids.append(int(tid))
        self.eos_token_ids: list[int] = ids
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)
        self.all_special_ids: list[int] = list(hf.all_special_ids)
        template = hf.chat_template
        if isinstance(template, dict):  # several named templates: use the default one
            template = template.get("default") or next(iter(template.values()), None)
        self.chat_template: str | None = template

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; BOS is prepended only if this model's tokenizer does so itself."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Text of `ids`."""
        return self.hf.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Vocabulary strings of `ids` (byte-level BPE pieces such as 'Ġworld')."""
        return list(self.hf.convert_ids_to_tokens(ids))

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
