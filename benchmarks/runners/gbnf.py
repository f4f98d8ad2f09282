"""Python regexes as llama.cpp GBNF grammars, so llama-server decodes under the same constraint.

Covers what constrained-generation regexes use: literals, `.`, character classes (ranges,
`\\d`, `\\w`, `\\s`, negation), groups, alternation and greedy or lazy repetition (`*`, `+`,
`?`, `{m,n}`); `^` / `$` are dropped since the whole output must match anyway. Anything else
(look-arounds, back-references, negated categories inside a class) gives None: the caller then
decodes unconstrained and says so.
"""

from __future__ import annotations

from typing import Any

try:  # Python 3.11+
    import re._constants as sre_c
    import re._parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

_CATEGORIES = {
    sre_c.CATEGORY_DIGIT: "0-9",
    sre_c.CATEGORY_WORD: "a-zA-Z0-9_",
    sre_c.CATEGORY_SPACE: r" \t\n\r\x0B\x0C",
}


class _Unsupported(Exception):
    pass


def _esc(ch: str) -> str:
    """One character as a GBNF escape unless it is a plain letter, digit or space."""
    if ch.isascii() and (ch.isalnum() or ch == " "):
        return ch
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02X}"
    if code < 0x10000:
        return f"\\u{code:04X}"
    return f"\\U{code:08X}"


def _class(items: list[tuple[Any, Any]]) -> str:
    negate = ""
    parts = []
    for op, arg in items:
        if op is sre_c.NEGATE:
            negate = "^"
        elif op is sre_c.LITERAL:
            parts.append(_esc(chr(arg)))
        elif op is sre_c.RANGE:
            parts.append(f"{_esc(chr(arg[0]))}-{_esc(chr(arg[1]))}")
        elif op is sre_c.CATEGORY and arg in _CATEGORIES:
            parts.append(_CATEGORIES[arg])
        else:
            raise _Unsupported(f"{op} in a character class")
    return "[" + negate + "".join(parts) + "]"


def _seq(pattern: Any) -> str:
    out: list[str] = []
    literal = ""
    for op, arg in pattern:
        if op is sre_c.LITERAL:
            literal += _esc(chr(arg))
            continue
        if literal:
            out.append(f'"{literal}"')
            literal = ""
        if op is sre_c.NOT_LITERAL:
            out.append(f"[^{_esc(chr(arg))}]")
        elif op is sre_c.ANY:
            out.append(r"[^\x0A]")
        elif op is sre_c.IN:
            out.append(_class(list(arg)))
        elif op is sre_c.BRANCH:
            out.append("(" + " | ".join(_seq(p) or '""' for p in arg[1]) + ")")
        elif op is sre_c.SUBPATTERN:
            out.append("(" + (_seq(arg[-1]) or '""') + ")")
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", None)):
            lo, hi, item = arg
            body = "(" + (_seq(item) or '""') + ")"
            if (lo, hi) == (0, sre_c.MAXREPEAT):
                out.append(body + "*")
            elif (lo, hi) == (1, sre_c.MAXREPEAT):
                out.append(body + "+")
            elif (lo, hi) == (0, 1):
                out.append(body + "?")
            elif hi == sre_c.MAXREPEAT:
                out.append(f"{body}{{{lo},}}")
            else:
                out.append(f"{body}{{{lo},{hi}}}")
        elif op is sre_c.AT and arg in (sre_c.AT_BEGINNING, sre_c.AT_END, sre_c.AT_END_STRING):
            continue
        else:
            raise _Unsupported(str(op))
    if literal:
        out.append(f'"{literal}"')
    return " ".join(out)


def regex_to_gbnf(pattern: str) -> str | None:
    """A GBNF grammar (rule `root`) accepting exactly the strings `pattern` fully matches, or
    None when the regex uses something this converter does not handle."""
    try:
        body = _seq(sre_parse.parse(pattern))
    except Exception:  # _Unsupported, or a pattern `re` itself rejects
        return None
    return "root ::= " + (body or '""') + "\n"


def literal_gbnf(text: str) -> str:
    """A grammar accepting exactly `text` (used to force a `select` choice)."""
    return 'root ::= "' + "".join(_esc(c) for c in text) + '"\n'
