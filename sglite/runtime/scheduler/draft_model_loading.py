"""Loading a draft model for `draft_model.DraftModelProposer`: the second model, in the
target's dtype and device, checked against the target (one tokenizer, no images), and the
draft vocabulary its tokens are chosen from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglite.runtime.scheduler.draft_vocabulary import DraftVocabulary, SpaceVariants

if TYPE_CHECKING:
    from sglite.runtime.model.loader import LoadedModel
    from sglite.runtime.server_args import ServerArgs


def load_draft_model(
    args: ServerArgs, target: LoadedModel
) -> tuple[LoadedModel, DraftVocabulary | None]:
    """Load `args.speculative_draft_model_path` in the target's dtype and device, and its draft
    vocabulary (None: drafts chosen over the whole head).

    Raises ValueError when its tokenizer's vocabulary is not the target's (its token ids
    would mean other text), or the target is a vision-language model.
    """
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.multimodal.spec import vision_spec

    assert args.speculative_draft_model_path is not None
    if vision_spec(target.model_path) is not None:
        raise ValueError(
            "draft-model speculation does not take images: the draft model cannot read a "
            "vision-language model's image positions (use --speculative-algorithm ngram)"
        )
    # The target's own file (self-speculation) reads the target's tokenizer files too.
    own_file = args.speculative_draft_model_path in (args.model_path, target.model_path)
    draft = load_model(
        args.speculative_draft_model_path,
        dtype=target.dtype,
        tokenizer_path=args.tokenizer_path if own_file else None,
        device=target.device,
        progress=False,
        quantization=args.speculative_draft_model_quantization,
        gemm_packing="off",  # the draft runs small decode batches only
        gguf_activations=args.gguf_activations,
        mmap_weights=args.mmap_weights,
        gguf_tiles=True,  # its passes are a few rows: the tiled GEMM's best case
    )
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(
            f"speculative_draft_model_path {args.speculative_draft_model_path!r}: its "
            "tokenizer's vocabulary differs from the target model's"
        )
    # Its weights move into 2 MB pages after the target's (`Scheduler.run_background_work`).
    if draft.huge_pages is not None:
        target.huge_pages = (
            target.huge_pages.join(draft.huge_pages) if target.huge_pages else draft.huge_pages
        )
    if args.speculative_draft_num_layers is not None:
        draft.model.keep_first_layers(args.speculative_draft_num_layers)
        draft.config = draft.model.config
    added = list(target.tokenizer.backend.get_added_tokens_decoder())
    vocab = DraftVocabulary.for_model(
        draft.model.output_projection(),
        args.speculative_draft_vocab_size,
        added,
        SpaceVariants.for_tokenizer(target.tokenizer),
    )
    return draft, vocab
