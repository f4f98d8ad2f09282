"""The kernels library's C ABI, read from `kernels.h`: its constants, its structs as ctypes
structures and its functions' ctypes signatures. The header is the one place the contract is
written; Python mirrors nothing by hand.

Only the subset of C that `kernels.h` promises to keep to is understood (see its top comment);
anything else there raises `ValueError` naming the declaration, so a header edit that breaks the
contract fails at import rather than passing wrong arguments to C.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path

HEADER = Path(__file__).with_name("kernels.h")

_SCALARS: dict[str, type] = {
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}
_RESULTS: dict[str, type | None] = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64}
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_ENUM = re.compile(r"enum\s*\{([^}]*)\}\s*;")
_STRUCT = re.compile(r"typedef\s+struct\s*\{([^}]*)\}\s*(\w+)\s*;")
_PROTOTYPE = re.compile(r"^\s*(void|int|int64_t)\s+(\w+)\s*\(([^)]*)\)\s*;", re.M)


@dataclass(frozen=True)
class Signature:
    """A C function's ctypes `restype` and `argtypes`."""

    restype: type | None
    argtypes: tuple[type, ...]


@dataclass
class Abi:
    """Everything `kernels.h` declares."""

    constants: dict[str, int] = field(default_factory=dict)
    structs: dict[str, type[ctypes.Structure]] = field(default_factory=dict)
    functions: dict[str, Signature] = field(default_factory=dict)

    def declare(self, lib: ctypes.CDLL) -> None:
        """Give every function of `lib` its signature (AttributeError if one is missing)."""
        for name, signature in self.functions.items():
            fn = getattr(lib, name)
            fn.restype = signature.restype
            fn.argtypes = list(signature.argtypes)


def _c_type(decl: str, structs: dict[str, type[ctypes.Structure]]) -> type:
    """The ctypes type of one declared name's type (`const int64_t *` -> c_void_p)."""
    if "*" in decl:
        return ctypes.c_void_p
    words = [w for w in decl.split() if w != "const"]
    if len(words) == 1 and words[0] in _SCALARS:
        return _SCALARS[words[0]]
    if len(words) == 1 and words[0] in structs:
        return structs[words[0]]
    raise ValueError(f"kernels.h: type {decl!r} is outside the ABI's subset")


def _struct_fields(body: str, structs: dict[str, type[ctypes.Structure]]) -> list[tuple]:
    """`type a, *b;` declarations as ctypes `_fields_` entries, in order."""
    fields = []
    for declaration in filter(None, (d.strip() for d in body.split(";"))):
        first, *others = [part.strip() for part in declaration.split(",")]
        match = re.fullmatch(r"(.*?)([*\s]+)(\w+)", first)
        if match is None:
            raise ValueError(f"kernels.h: cannot read the field declaration {declaration!r}")
        base = match.group(1)
        for name_part in [match.group(2) + match.group(3), *others]:
            stars = "*" * name_part.count("*")
            name = name_part.replace("*", "").strip()
            fields.append((name, _c_type(f"{base} {stars}", structs)))
    return fields


def _parameter_type(parameter: str, structs: dict[str, type[ctypes.Structure]]) -> type:
    """A prototype parameter's ctypes type (the name after the type is dropped)."""
    match = re.fullmatch(r"(.*?[\s*])(\w+)", parameter.strip())
    if match is None:
        raise ValueError(f"kernels.h: cannot read the parameter {parameter!r}")
    return _c_type(match.group(1), structs)


def parse(text: str) -> Abi:
    """The ABI declared by a header's text (see the module docstring)."""
    text = _COMMENT.sub(" ", text)
    abi = Abi()
    for body in _ENUM.findall(text):
        for item in filter(None, (i.strip() for i in body.split(","))):
            name, _, value = (part.strip() for part in item.partition("="))
            abi.constants[name] = int(value, 0)
    for body, name in _STRUCT.findall(text):
        fields = _struct_fields(body, abi.structs)
        abi.structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    for result, name, params in _PROTOTYPE.findall(text):
        params = params.strip()
        argtypes = () if params in ("", "void") else params.split(",")
        abi.functions[name] = Signature(
            _RESULTS[result], tuple(_parameter_type(p, abi.structs) for p in argtypes)
        )
    return abi


ABI = parse(HEADER.read_text())
