"""The JSON benchmark's constraints: the two kinds of extracted object (cities, characters)
and, for each, the JSON schema, the equivalent SGLang-style regex, the regex as a llama.cpp GBNF
grammar, and the check that a parsed object fits the schema."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    """One field of the extracted object: a string of at most `size` characters, or a
    non-negative integer of at most `size` digits."""

    key: str
    kind: str  # "str" or "int"
    size: int


@dataclass(frozen=True)
class Kind:
    """A kind of document and the object extracted from it."""

    name: str
    fields: tuple[Field, ...]

    def schema(self) -> dict:
        """The JSON schema: every field required, nothing else allowed."""
        props = {}
        for f in self.fields:
            if f.kind == "str":
                props[f.key] = {"type": "string", "minLength": 1, "maxLength": f.size}
            else:
                props[f.key] = {"type": "integer", "minimum": 0, "maximum": 10**f.size - 1}
        return {
            "type": "object",
            "properties": props,
            "required": [f.key for f in self.fields],
            "additionalProperties": False,
        }

    def regex(self) -> str:
        """The equivalent regex, SGLang style: one field per line, indented by four spaces."""
        lines = []
        for f in self.fields:
            value = rf'"[\w\d\s]{{1,{f.size}}}"' if f.kind == "str" else _int_regex(f.size)
            lines.append(rf'    "{f.key}": {value}')
        return r"\{\n" + r",\n".join(lines) + r"\n\}"

    def gbnf(self) -> str:
        """The regex as a GBNF grammar for llama.cpp (`\\w`, `\\s` as ASCII classes)."""
        parts, rules = [], {}
        for i, f in enumerate(self.fields):
            sep = '"{\\n' if i == 0 else '",\\n'
            parts.append(f'{sep}    \\"{f.key}\\": "')
            name = f"{f.kind}{f.size}"
            parts.append(name)
            if f.kind == "str":
                rules[name] = f'"\\"" [a-zA-Z0-9_ \\t\\n\\r]{{1,{f.size}}} "\\""'
            else:
                rules[name] = f'"0" | [1-9] [0-9]{{0,{f.size - 1}}}'
        parts.append('"\\n}"')
        root = "root ::= " + " ".join(parts)
        return "\n".join([root] + [f"{name} ::= {rule}" for name, rule in rules.items()])

    def check(self, obj: object) -> bool:
        """Whether a parsed object fits the schema (jsonschema when installed)."""
        try:
            import jsonschema
        except ImportError:
            return self._check_by_hand(obj)
        try:
            jsonschema.validate(obj, self.schema())
        except jsonschema.ValidationError:
            return False
        return True

    def _check_by_hand(self, obj: object) -> bool:
        if not isinstance(obj, dict) or set(obj) != {f.key for f in self.fields}:
            return False
        for f in self.fields:
            v = obj[f.key]
            if f.kind == "str" and not (isinstance(v, str) and 1 <= len(v) <= f.size):
                return False
            if f.kind == "int" and not (
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 10**f.size
            ):
                return False
        return True


def _int_regex(digits: int) -> str:
    """A JSON non-negative integer of at most `digits` digits (no leading zeros)."""
    return rf"(0|[1-9][0-9]{{0,{digits - 1}}})"


CITY = Kind(
    "city",
    (
        Field("name_of_the_city", "str", 24),
        Field("country_the_city_is_in", "str", 24),
        Field("population_of_the_city", "int", 9),
        Field("year_the_city_was_founded", "int", 4),
        Field("name_of_the_current_mayor", "str", 32),
    ),
)
CHARACTER = Kind(
    "character",
    (
        Field("full_name_of_the_character", "str", 32),
        Field("age_of_the_character_in_years", "int", 3),
        Field("occupation_of_the_character", "str", 24),
        Field("hometown_of_the_character", "str", 24),
        Field("favourite_hobby_of_the_character", "str", 24),
    ),
)
