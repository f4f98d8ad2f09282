"""The C kernels build for the CPUs users have, not only for this host: the portable path
(x86-64 baseline, and aarch64 with a cross compiler), the AVX2 and the AVX-512 paths all compile
without a warning; and a server whose kernels fail to build still serves the same answers."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest
import requests

from sglite.runtime.model.kernels import native

TARGETS = {
    "x86-64 baseline (portable C)": ("gcc", ["-march=x86-64"]),
    "x86-64 AVX2 (Haswell, Zen 1-3)": ("gcc", ["-march=x86-64-v3"]),
    "x86-64 AVX-512 with BF16 and VNNI (Zen 4-5, Sapphire Rapids)": (
        "gcc",
        ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
    ),
    "aarch64 (Graviton, Apple Silicon under Linux)": ("aarch64-linux-gnu-gcc", ["-march=armv8-a"]),
}


def test_kernels_compile_without_warnings(tmp_path):
    """Every target's build, two at a time (one per core)."""
    runs = {}
    for target, (compiler, flags) in TARGETS.items():
        if shutil.which(compiler) is None:
            continue  # scripts/test.sh installs the cross compiler where it can (as root)
        sources = [str(source) for source in native.SOURCES]
        folder = tmp_path / compiler / str(len(runs))
        folder.mkdir(parents=True)
        cmd = [
            compiler,
            "-O2",
            "-std=gnu11",
            "-fopenmp",
            "-Wall",
            "-Werror",
            *flags,
            "-c",
            *sources,
        ]
        runs[target] = subprocess.Popen(
            cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        if len([p for p in runs.values() if p.poll() is None]) >= 2:
            next(p for p in runs.values() if p.poll() is None).wait(timeout=600)
    for target, proc in runs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{target}:\n{err[-3000:]}"
    assert "x86-64 baseline (portable C)" in runs
    if os.geteuid() == 0 and shutil.which("apt-get"):  # where the test command installs it
        assert "aarch64 (Graviton, Apple Silicon under Linux)" in runs


def test_a_failed_kernel_build_still_serves_the_same_answers(tmp_path, sglite_server):
    """No compiler that works (here one that always fails) and no cached library: the server
    logs the failure, runs PyTorch's kernels (and dense weights, `auto` needing the native ones)
    and answers as the native server does."""
    from server_fixtures import ServerProcess

    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    failing.chmod(0o755)
    env = {"CC": str(failing), "SGLITE_KERNEL_CACHE": str(tmp_path / "cache")}
    server = ServerProcess(env=env)
    try:
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 12,
                "temperature": 0}}  # fmt: skip
        plain = requests.post(server.url + "/generate", json=body, timeout=120).json()
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
        assert info["native_kernels"] is False and info["quantization"] == "none"
        native_answer = requests.post(sglite_server.url + "/generate", json=body, timeout=120)
        assert plain["text"] == native_answer.json()["text"]
        assert "native CPU kernels unavailable" in server.output()
    finally:
        server.stop()
    assert os.environ.get("CC") != str(failing)


def test_the_structs_python_builds_from_the_header_match_the_compilers_layout(tmp_path):
    """native.py passes the decode step's layer table as ctypes structs built from kernels.h;
    their size and every field's offset equal what the C compiler lays out."""
    from sglite.runtime.model.kernels.abi import ABI, HEADER

    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        f'#include "{HEADER}"',
        "int main(void) {",
    ]
    for name, struct in ABI.structs.items():
        lines.append(f'  printf("{name} %zu\\n", sizeof({name}));')
        for field, _ in struct._fields_:
            lines.append(f'  printf("{name}.{field} %zu\\n", offsetof({name}, {field}));')
    lines += ["  return 0;", "}"]
    (tmp_path / "layout.c").write_text("\n".join(lines))
    subprocess.run(["gcc", "-o", "layout", "layout.c"], cwd=tmp_path, check=True)
    compiled = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True).stdout
    expected = []
    for name, struct in ABI.structs.items():
        expected.append(f"{name} {ctypes.sizeof(struct)}")
        expected += [f"{name}.{f} {getattr(struct, f).offset}" for f, _ in struct._fields_]
    assert compiled.split("\n")[:-1] == expected
    assert {"linear_t", "layer_t"} <= set(ABI.structs)


def test_every_function_the_header_declares_is_in_the_library():
    """The library loads with every declared function (a missing one would make `load()` fall
    back to PyTorch), and the constants Python uses come from the header."""
    from sglite.runtime.model.kernels.abi import ABI

    lib = native.load()
    assert lib is not None
    assert all(hasattr(lib, name) for name in ABI.functions)
    assert ABI.constants["QGEMV_MAX_ROWS"] >= ABI.constants["INT4_FLOAT_GEMV_MAX_ROWS"] >= 1


def test_a_header_outside_the_parsed_subset_is_refused():
    from sglite.runtime.model.kernels.abi import parse

    with pytest.raises(ValueError, match="double"):
        parse("typedef struct { double weight; } bad_t;")
    with pytest.raises(ValueError, match="unsigned"):
        parse("int f(unsigned char c);")
    abi = parse(
        "enum { A = 0x10 };\ntypedef struct { int64_t n, *p; } s_t;\nint64_t g(const s_t *s);"
    )
    assert abi.constants == {"A": 16}
    assert [f for f, _ in abi.structs["s_t"]._fields_] == ["n", "p"]
    assert abi.functions["g"].argtypes == (ctypes.c_void_p,)
