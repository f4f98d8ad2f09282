"""Which subsystem may import which: the router and the shared HTTP and load-balancing packages
stay free of the runtime (and torch), data parallelism does not reach into the router, and the
KV cache's bookkeeping does not reach into the model."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "sglite"


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a source file imports (relative imports resolved to sglite.*)."""
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def offending_imports(sources: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    """`file: module` for every import of a forbidden package (or one of its modules)."""
    out = []
    for path in sources:
        for module in sorted(imported_modules(path)):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(ROOT.parent)}: {module}")
    return out


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("router", ("sglite.runtime", "torch")),
        ("http", ("sglite.runtime", "sglite.router", "torch")),
        ("load_balancing", ("sglite.runtime", "sglite.router", "torch")),
        ("runtime/cache", ("sglite.runtime.model",)),
    ],
)
def test_package_imports_stay_in_their_layer(package: str, forbidden: tuple[str, ...]) -> None:
    sources = sorted((ROOT / package).rglob("*.py"))
    assert sources
    assert offending_imports(sources, forbidden) == []


def test_data_parallel_does_not_import_the_router() -> None:
    assert offending_imports([ROOT / "runtime" / "data_parallel.py"], ("sglite.router",)) == []


def run_probe(code: str) -> str:
    """What `code` prints in a fresh interpreter (which modules an import loads)."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.strip()


def test_router_app_imports_no_torch_and_no_server() -> None:
    probe = (
        "import sys, sglite.router.app, sglite.router.launch\n"
        "heavy = [m for m in sys.modules if m == 'torch' or m.startswith(('sglite.runtime.server',"
        " 'sglite.runtime.model', 'sglite.runtime.scheduler'))]\n"
        "print(','.join(sorted(heavy)))\n"
    )
    assert run_probe(probe) == ""


def test_the_server_processes_start_without_the_language() -> None:
    """`sglite serve` and its scheduler process import runtime modules only: the language
    (sglite.lang, a tenth of a second of imports) loads when a program first reads one of its
    names from `sglite`, which still gives every one of them."""
    probe = (
        "import sys, sglite.cli, sglite.runtime.scheduler.process\n"
        "print('sglite.lang' in sys.modules, end=' ')\n"
        "import sglite as sgl\n"
        "missing = [n for n in sgl.__all__ if n != 'Engine' and getattr(sgl, n, None) is None]\n"
        "print('sglite.lang' in sys.modules, 'torch' in sys.modules, missing)\n"
    )
    assert run_probe(probe) == "False True False []"
