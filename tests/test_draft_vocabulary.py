"""The draft vocabulary (`scheduler/draft_vocabulary.py`): a draft model's greedy token chosen
among the head's first ids, the added tokens, the prompt's own ids and their other spellings as
to a leading space, and the ids the request has written: the whole head's argmax over exactly
those ids, by the same kernel. The tokenizer is the default model's (byte-level BPE, as
Qwen2.5's); the heads are random Q8_0 blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sglite.runtime.model.gguf_part import GGUFPart
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.loader import load_tokenizer
from sglite.runtime.scheduler.draft_vocabulary import DraftVocabulary, SpaceVariants
from sglite.runtime.server_args import ServerArgs


def _q8_head(rows: int, k: int, seed: int) -> GGUFWeight:
    weights = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    return GGUFWeight([GGUFPart("Q8_0", blocks)], k, None, True)


def test_the_draft_vocabulary_picks_the_heads_argmax_over_its_allowed_ids():
    """The draft's token is what the whole head's logits pick among the first `size` ids, the
    added tokens and the prompt's own: the same blocks through the same kernel, bit for bit;
    and it is really restricted (hidden states whose unrestricted argmax lies elsewhere)."""
    head = _q8_head(300, 64, seed=3)
    vocab = DraftVocabulary(head, 100, added_ids=[290, 295, 5000])
    request = vocab.rows_for([5, 150, 150, 299, 40, 7000])
    assert request.ids == [150, 290, 295, 299]  # past the prefix, within the head, once each
    allowed = torch.tensor(vocab.allowed_for(request))
    restricted = 0
    for seed in range(40):
        hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed))
        logits = head.matmul_decode(hidden.to(torch.bfloat16))[0]
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        got, probability = vocab.choose_many(hidden, [request], torch.bfloat16)[0]
        assert got == int(torch.argmax(masked)), seed
        assert probability == pytest.approx(float(torch.softmax(masked.float(), 0)[got]))
        restricted += int(torch.argmax(logits)) != got
    assert restricted > 10
    assert vocab.rows_for([1, 2, 3]).ids == [290, 295]


def test_the_draft_vocabulary_is_off_where_it_cannot_help():
    head = _q8_head(64, 32, seed=4)
    assert DraftVocabulary.for_model(head, 0, []) is None  # the flag's "whole vocabulary"
    assert DraftVocabulary.for_model(head, 64, []) is None  # no smaller than the head
    assert DraftVocabulary.for_model(torch.zeros(64, 32), 16, []) is None  # not GGUF blocks
    assert DraftVocabulary.for_model(head, 16, []).size == 16
    with pytest.raises(ValueError, match="speculative_draft_vocab_size"):
        ServerArgs(speculative_draft_vocab_size=-1).validate()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _restricted_argmax(head: GGUFWeight, hidden: torch.Tensor, allowed: list[int]) -> int:
    logits = head.matmul_decode(hidden.to(torch.bfloat16))[0]
    masked = torch.full_like(logits, float("-inf"))
    masked[torch.tensor(allowed)] = logits[torch.tensor(allowed)]
    return int(torch.argmax(masked))


def test_space_variants_spell_a_token_with_and_without_its_leading_space(tokenizer):
    """A prompt's " seller" is a JSON record's "seller": each is the other's variant where the
    vocabulary has both as one token; a token with no such twin has none."""
    variants = SpaceVariants.for_tokenizer(tokenizer)
    assert variants is not None and variants.mark == "\u0120"
    spaced, bare = tokenizer.token_to_id("\u0120seller"), tokenizer.token_to_id("seller")
    assert variants.of(spaced) == bare and variants.of(bare) == spaced
    assert tokenizer.token_to_id("buyer") is None
    assert variants.of(tokenizer.token_to_id("\u0120buyer")) is None
    assert SpaceVariants.for_tokenizer(object()) is None  # no vocabulary lookups to read


def test_a_requests_candidates_take_its_prompts_other_spellings_and_what_it_writes(tokenizer):
    """Past the prefix, a request may draft its prompt's ids, their other spellings, and, as it
    writes them, ids its output brought (an edit's new name, a closing code fence); the
    choice is the head's argmax over exactly those, and a token the request has not seen is
    never chosen."""
    size = 1000
    head = _q8_head(tokenizer.vocab_size, 32, seed=5)
    vocab = DraftVocabulary(
        head, size, added_ids=[], variants=SpaceVariants.for_tokenizer(tokenizer)
    )
    prompt = tokenizer.encode("Document: the seller and buyer", add_special_tokens=False)
    spaced, bare = tokenizer.token_to_id("\u0120seller"), tokenizer.token_to_id("seller")
    written, twin = tokenizer.token_to_id("xs"), tokenizer.token_to_id("\u0120xs")
    assert min(spaced, bare, written, twin) >= size and bare not in prompt
    request = vocab.rows_for(prompt)
    assert spaced in request.ids and bare in request.ids and written not in request.ids
    assert vocab.with_written(request, prompt) is request  # nothing new: no rows copied
    grown = vocab.with_written(request, prompt + [5, written])
    assert grown.ids == sorted({*request.ids, written, twin})
    assert vocab.with_written(grown, prompt + [5, written, written]) is grown
    for seed in range(40):
        hidden = torch.randn(1, 32, generator=torch.Generator().manual_seed(seed))
        for req in (request, grown):
            got, _ = vocab.choose_many(hidden, [req], torch.bfloat16)[0]
            assert got == _restricted_argmax(head, hidden, vocab.allowed_for(req)), seed
    # a state that points at the written id: chosen once written, never before
    toward = 4.0 * head.rows(torch.tensor([written]), torch.float32)
    assert vocab.choose_many(toward, [grown], torch.bfloat16)[0][0] == written
    assert vocab.choose_many(toward, [request], torch.bfloat16)[0][0] not in (written, twin)
