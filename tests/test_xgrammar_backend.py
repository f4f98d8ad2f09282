"""The optional xgrammar grammar backend, on the default model's tokenizer (no model weights).

Skipped when xgrammar is not installed (`scripts/install_xgrammar.sh` installs it).
"""

from __future__ import annotations

import json

import pytest

xgrammar = pytest.importorskip("xgrammar")

from sglite.runtime.constrained.base import Constraint, GrammarError  # noqa: E402
from sglite.runtime.constrained.bitmask import allocate_bitmask  # noqa: E402
from sglite.runtime.constrained.xgrammar_backend import (  # noqa: E402
    XGrammarBackend,
    XGrammarMatcher,
    validate_constraint,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
LONG_KEY = {
    "type": "object",
    "properties": {"a_rather_long_property_name_for_testing": {"type": "string"}},
    "required": ["a_rather_long_property_name_for_testing"],
}
EBNF = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'


@pytest.fixture(scope="module")
def tok():
    from sglite.runtime.model.loader import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def backend(tok):
    return XGrammarBackend(tok, len(tok), tok.eos_token_ids)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def allowed(mask, row: int, token_id: int) -> bool:
    return bool((int(mask[row, token_id // 32]) >> (token_id % 32)) & 1)


def accept_all(matcher, ids: list[int]) -> None:
    for t in ids:
        assert matcher.accept_token(t), f"token {t} rejected"


def test_backend_name():
    assert XGrammarBackend.name == "xgrammar"


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("regex", r"[a-z]+@[a-z]+\.com"),
        Constraint("json_schema", json.dumps(PERSON)),
        Constraint("json_schema", "true"),
        Constraint("ebnf", EBNF),
    ],
)
def test_valid_constraints_compile(backend, constraint):
    validate_constraint(constraint)
    matcher = backend.compile(constraint)
    assert isinstance(matcher, XGrammarMatcher)
    assert not matcher.is_terminated()


@pytest.mark.parametrize(
    "constraint, needle",
    [
        (Constraint("regex", "[a-"), "regex"),
        (Constraint("json_schema", '{"type": "foo"}'), "json_schema"),
        (Constraint("json_schema", "{not json"), "not valid JSON"),
        (Constraint("json_schema", "[1, 2]"), "JSON object"),
        (Constraint("ebnf", 'root ::= "a" | undefined_rule'), "undefined_rule"),
        (Constraint("ebnf", 'root ::= ("a"'), "ebnf"),
    ],
)
def test_invalid_constraints_raise(backend, constraint, needle):
    with pytest.raises(GrammarError) as info:
        validate_constraint(constraint)
    message = str(info.value)
    assert needle in message and len(message) > len(needle)
    assert "/project/cpp" not in message  # xgrammar's log prefix is stripped
    with pytest.raises(GrammarError):
        backend.compile(constraint)


def test_json_mask_inside_string(tok, backend):
    matcher = backend.compile(Constraint("json_schema", json.dumps(PERSON)))
    accept_all(matcher, encode(tok, '{"name": "'))
    mask = allocate_bitmask(2, len(tok))
    matcher.fill_bitmask(mask, 1)
    letters = encode(tok, "Alice")[0]
    assert allowed(mask, 1, letters)
    assert allowed(mask, 1, encode(tok, '",')[0])  # the name may end, then "age" comes
    # `}` is a legal character inside the string, but closing the string and the object at
    # once (`"}`) skips the required "age", and a raw newline is not allowed in a JSON string
    (close_brace,) = encode(tok, '"}')
    assert not allowed(mask, 1, close_brace)
    assert not allowed(mask, 1, encode(tok, "\n")[0])
    for eos in tok.eos_token_ids:
        assert not allowed(mask, 1, eos)
    assert int(mask[0].eq(-1).sum()) == mask.shape[1]  # other rows untouched


def test_fixed_separators(tok, backend):
    """No free whitespace: after the key only `": "` may follow, as in llguidance."""
    matcher = backend.compile(Constraint("json_schema", json.dumps(PERSON)))
    accept_all(matcher, encode(tok, '{"name'))
    assert matcher.forced_text() == b'": "'
    accept_all(matcher, encode(tok, '":'))
    mask = allocate_bitmask(1, len(tok))
    matcher.fill_bitmask(mask, 0)
    assert allowed(mask, 0, encode(tok, ' "')[0])
    assert not allowed(mask, 0, tok.token_to_id('"'))  # no `":"` without the space
    assert not allowed(mask, 0, tok.token_to_id("Ċ"))  # nor a newline


def test_forced_tokens_long_key(tok, backend):
    matcher = backend.compile(Constraint("json_schema", json.dumps(LONG_KEY)))
    text = matcher.forced_text()
    assert text == b'{"a_rather_long_property_name_for_testing": "'
    forced = matcher.forced_tokens()
    assert len(forced) >= 5
    decoded = tok.decode(forced, skip_special_tokens=False).encode()
    assert text.startswith(decoded) and decoded != text  # the last token is held back
    accept_all(matcher, forced)  # a draft the grammar accepts
    assert text.endswith(matcher.forced_text())


def test_forced_tokens_whole_rest(tok, backend):
    """When the forced text is all the grammar allows, its last token is kept."""
    matcher = backend.compile(Constraint("regex", "hello world"))
    assert matcher.forced_text() == b"hello world"
    forced = matcher.forced_tokens()
    assert tok.decode(forced, skip_special_tokens=False) == "hello world"
    accept_all(matcher, forced)
    assert matcher.is_terminated()
    assert matcher.forced_tokens() == [] and matcher.forced_text() == b""


def test_accept_rollback_copy(tok, backend):
    matcher = backend.compile(Constraint("regex", "(abc|abd)[0-9]+"))
    ab = encode(tok, "ab")
    accept_all(matcher, ab)
    c, d = tok.token_to_id("c"), tok.token_to_id("d")
    assert matcher.accept_token(c)
    matcher.rollback(1)
    assert matcher.accept_token(d)  # rollback restored the state before "c"

    clone = matcher.copy()
    one = tok.token_to_id("1")
    assert clone.accept_token(one)
    mask = allocate_bitmask(2, len(tok))
    matcher.fill_bitmask(mask, 0)
    clone.fill_bitmask(mask, 1)
    eos = tok.eos_token_ids[0]
    assert not allowed(mask, 0, eos)  # the original has no digit yet
    assert allowed(mask, 1, eos)  # the copy does
    assert not matcher.is_terminated() and not clone.is_terminated()

    x = tok.token_to_id("x")
    assert not matcher.accept_token(x)  # rejected: a sticky error, as in llguidance
    assert matcher.is_terminated()
    matcher.fill_bitmask(mask, 0)
    assert allowed(mask, 0, eos) and int(mask[0].ne(0).sum()) == 1
    assert clone.accept_token(one)  # the copy is independent


def test_count_allowed(tok, backend):
    matcher = backend.compile(Constraint("regex", "abc[0-9]"))
    ids = [tok.token_to_id(c) for c in "abc1x"]
    assert matcher.count_allowed(ids) == 4
    assert matcher.count_allowed(ids[:2]) == 2 and matcher.count_allowed([ids[4]]) == 0
    assert matcher.accepted == [] and matcher.forced_text() == b"abc"  # state unchanged
    accept_all(matcher, ids[:4])
    assert matcher.count_allowed([tok.eos_token_ids[0], ids[0]]) == 1
    assert matcher.is_terminated()  # still only EOS may follow, nothing was consumed
    assert matcher.accept_token(tok.eos_token_ids[0])


def test_copy_without_fork(tok, backend, monkeypatch):
    """Copies replay the accepted tokens when xgrammar has no `fork`."""
    matcher = backend.compile(Constraint("json_schema", json.dumps(PERSON)))
    accept_all(matcher, encode(tok, '{"name": "Bo'))
    monkeypatch.delattr(xgrammar.GrammarMatcher, "fork", raising=False)
    clone = matcher.copy()
    assert clone.accepted == matcher.accepted
    assert clone.forced_text() == matcher.forced_text()
    accept_all(clone, encode(tok, '", "age": 7}'))
    assert clone.is_terminated()
    assert not matcher.is_terminated()


@pytest.mark.parametrize(
    "constraint, text",
    [
        (Constraint("json_schema", json.dumps(PERSON)), '{"name": "Ada Lovelace", "age": 36}'),
        (Constraint("regex", r"[a-z]+@[a-z]+\.com"), "ada@example.com"),
        (Constraint("ebnf", EBNF), "maybe 7"),
        (Constraint("ebnf", EBNF), "yes"),
    ],
)
def test_language_text_accepted(tok, backend, constraint, text):
    matcher = backend.compile(constraint)
    mask = allocate_bitmask(1, len(tok))
    for t in encode(tok, text):
        matcher.fill_bitmask(mask, 0)
        assert allowed(mask, 0, t), f"token {t} masked out"
        assert matcher.accept_token(t)
    matcher.fill_bitmask(mask, 0)
    for eos in tok.eos_token_ids:
        assert allowed(mask, 0, eos)
    assert matcher.is_terminated()
    assert matcher.accept_token(tok.eos_token_ids[-1])
    assert matcher.is_terminated()
    matcher.fill_bitmask(mask, 0)
    assert allowed(mask, 0, tok.eos_token_ids[0])


def test_eos_allowed_but_not_terminated(tok, backend):
    """A complete text that may still grow: EOS allowed, more allowed, not terminated."""
    matcher = backend.compile(Constraint("regex", "[0-9]+"))
    accept_all(matcher, encode(tok, "4"))
    mask = allocate_bitmask(1, len(tok))
    matcher.fill_bitmask(mask, 0)
    assert allowed(mask, 0, tok.eos_token_ids[0])
    assert allowed(mask, 0, encode(tok, "2")[0])
    assert not matcher.is_terminated()


def test_extra_eos_ids_act_as_eos(tok):
    """Every id in eos_token_ids is allowed where EOS is, and ends the output."""
    extra = tok.token_to_id("<|im_start|>")
    assert isinstance(extra, int) and extra not in tok.eos_token_ids
    backend = XGrammarBackend(tok, len(tok), [*tok.eos_token_ids, extra])
    matcher = backend.compile(Constraint("regex", "ok"))
    mask = allocate_bitmask(1, len(tok))
    matcher.fill_bitmask(mask, 0)
    assert not allowed(mask, 0, extra)
    accept_all(matcher, encode(tok, "ok"))
    matcher.fill_bitmask(mask, 0)
    assert allowed(mask, 0, extra) and allowed(mask, 0, tok.eos_token_ids[0])
    assert matcher.accept_token(extra)
    assert matcher.is_terminated()


def test_grammar_manager_creates_xgrammar(tok):
    from sglite.runtime.constrained.grammar_manager import (
        GrammarManager,
        create_backend,
    )
    from sglite.runtime.constrained.grammar_manager import (
        validate_constraint as check,
    )

    backend = create_backend("xgrammar", tok, len(tok), tok.eos_token_ids)
    assert backend.name == "xgrammar"
    with pytest.raises(GrammarError):
        check("regex", "(", backend="xgrammar")
    manager = GrammarManager(backend)
    try:
        ticket = manager.submit(Constraint("regex", "[0-9]{3}"))
        ticket.future.result(timeout=60)
        matcher = ticket.result(timeout_s=60)
        assert isinstance(matcher, XGrammarMatcher)
        accept_all(matcher, encode(tok, "123"))
        assert matcher.is_terminated()
        again = manager.submit(Constraint("regex", "[0-9]{3}")).result(timeout_s=60)
        assert again is not matcher and not again.is_terminated()  # a fresh copy per request
    finally:
        manager.shutdown()


def test_engine_with_xgrammar_backend_generates_valid_json():
    """`--grammar-backend xgrammar` end to end: valid output, jump-forward drafts accepted."""
    import json

    import jsonschema

    import sglite

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer"},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    prompt = (
        "<|im_start|>user\nThe largest city of Japan, as JSON.<|im_end|>\n<|im_start|>assistant\n"
    )
    with sglite.Engine(dtype="float32", log_level="error", grammar_backend="xgrammar") as eng:
        assert eng.get_server_info()["grammar_backend"] == "xgrammar"
        params = {"json_schema": json.dumps(schema), "max_new_tokens": 48, "temperature": 0}
        out = eng.generate(prompt, params)
        jsonschema.validate(json.loads(out["text"]), schema)
        assert out["meta_info"]["jump_forward_accepted_tokens"] > 0
        regex = eng.generate(prompt, {"regex": "[0-9]{4}", "max_new_tokens": 8, "temperature": 0})
        assert len(regex["text"]) == 4 and regex["text"].isdigit()
        assert eng.check_invariants()["held_by_requests"] == 0
