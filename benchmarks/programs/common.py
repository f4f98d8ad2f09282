"""Helpers shared by the workloads: seeded randomness, greedy generation, shape checks.

The checks never judge answer quality (the default model is tiny); they only assert that a
program's variables exist and have the expected shape, naming the variable when they do not.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import sglite as sgl


def rng_for(seed: int, *keys: object) -> random.Random:
    """A generator seeded by `seed` and `keys`, identical in every process.

    String seeds go through SHA-512 in `random.Random`, so unlike `hash()` they do not change
    with PYTHONHASHSEED.
    """
    return random.Random("/".join(str(k) for k in (seed, *keys)))


def greedy_gen(name: str, max_tokens: int, **kwargs: Any) -> Any:
    """`sgl.gen` at temperature 0: the suite is greedy whatever defaults a runner passes."""
    return sgl.gen(name, max_tokens=max_tokens, temperature=0, **kwargs)


def assert_ok(state: Any) -> None:
    """The program ran to the end without an error."""
    error = state.error()
    assert error is None, f"program failed: {error!r}"


def get_var(state: Any, name: str) -> Any:
    """The variable `name`, or an AssertionError naming it when the program did not set it."""
    assert name in state, f"variable {name!r} is missing"
    return state[name]


def assert_str(value: Any, name: str) -> str:
    """`value` (the variable `name`) is a string with some text (a generation that produced
    nothing is a failure, not a result)."""
    assert isinstance(value, str), f"{name!r}: expected str, got {type(value).__name__}"
    assert value.strip(), f"{name!r}: the generation is empty"
    return value


def assert_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    """`value` (the variable `name`) is one of `choices`."""
    assert_str(value, name)
    assert value in choices, f"{name!r}: {value!r} is not one of {list(choices)!r}"
    return value


def assert_list(value: Any, name: str, length: int) -> list[Any]:
    """`value` (the variable `name`, gathered from forks) is a list of `length` items."""
    assert isinstance(value, list), f"{name!r}: expected list, got {type(value).__name__}"
    assert len(value) == length, f"{name!r}: expected {length} items, got {len(value)}"
    return value


def state_str(state: Any, name: str) -> str:
    """The string variable `name` of `state`."""
    return assert_str(get_var(state, name), name)


def state_choice(state: Any, name: str, choices: Sequence[str]) -> str:
    """The select variable `name` of `state`, checked to be one of `choices`."""
    return assert_choice(get_var(state, name), name, choices)


def state_json(state: Any, name: str) -> Any:
    """The variable `name` parsed as JSON (AssertionError naming it when it does not parse)."""
    text = state_str(state, name)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{name!r} is not JSON ({exc}): {text!r}") from None
