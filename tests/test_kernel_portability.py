"""The C kernels build for the CPUs users have, not only for this host: the portable path
(x86-64 baseline, and aarch64 with a cross compiler), the AVX2 and the AVX-512 paths all compile
without a warning; this host's vector path and aarch64's NEON (run under qemu) compute what the
portable C computes; the C ABI Python uses is the header's; and a server whose kernels fail to
build still serves the same answers."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path
from subprocess import Popen

import pytest
import requests
import torch

from sglite.runtime.model.kernels import native

# Targets built here only to check they compile without a warning; the portable C and aarch64
# builds are also run (test_every_vector_path_computes_what_the_portable_c_computes).
TARGETS = {
    "x86-64 AVX2 (Haswell, Zen 1-3)": ("gcc", ["-march=x86-64-v3"]),
    "x86-64 AVX-512 with BF16 and VNNI (Zen 4-5, Sapphire Rapids)": (
        "gcc",
        ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
    ),
}


def test_kernels_compile_without_warnings(tmp_path):
    """Both x86 vector targets, built at once (one per core)."""
    sources = [str(source) for source in native.SOURCES]
    runs = {}
    for i, (target, (compiler, flags)) in enumerate(TARGETS.items()):
        folder = tmp_path / str(i)
        folder.mkdir()
        cmd = [compiler, "-O2", "-std=gnu11", "-fopenmp", "-Wall", "-Werror", *flags, "-c"]
        runs[target] = subprocess.Popen(
            [*cmd, *sources], cwd=folder, stderr=subprocess.PIPE, text=True
        )
    for target, proc in runs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{target}:\n{err[-3000:]}"


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
        assert info["kernel_isa"] == [] and info["weight_layouts"] == ["blocked"]
        served = requests.get(sglite_server.url + "/get_server_info", timeout=30).json()
        assert served["native_kernels"] is True and served["kernel_isa"] == native.isa()
        assert served["quantization"] == "q4_1" and "q4_1" in served["weight_layouts"]
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


HARNESS = Path(__file__).with_name("kernel_harness.c")
QEMU = "qemu-aarch64-static"


def _build_harness(binary: Path, compiler: str, flags: list[str]) -> tuple[Path, Popen]:
    """Start building tests/kernel_harness.c for one target: (the binary, the compiler run)."""
    sources = [str(HARNESS), *map(str, native.SOURCES)]
    cmd = [compiler, "-O2", "-std=gnu11", "-fopenmp", "-Wall", "-Werror", *flags]
    cmd += [f"-I{native.SOURCES[0].parent}", "-o", str(binary), *sources, "-lm"]
    return binary, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)


def _harness_values(binary: Path, build: Popen, runner: list[str]) -> dict:
    """The built harness's output: {case: [values]}, and the vector width the build took
    (key "vec_width")."""
    _, err = build.communicate(timeout=600)
    assert build.returncode == 0, err[-3000:]
    lines = subprocess.run([*runner, str(binary)], capture_output=True, text=True, check=True)
    values: dict = {}
    for line in lines.stdout.splitlines():
        case, value = line.split()
        values.setdefault(case, []).append(float(value))
    return values


def test_every_vector_path_computes_what_the_portable_c_computes(tmp_path):
    """Every kernel on the same inputs: this host's vector build (AVX2 or AVX-512) and aarch64's
    NEON build agree with the portable C build to float32 rounding (bf16 outputs to one bf16
    step), case by case. Each build compiles without a warning (GCC 14 and Clang 16 reject an
    implicit declaration, as the portable path once had)."""
    builds = {
        "portable C": ("gcc", ["-march=x86-64"], []),
        "this host": ("gcc", ["-march=native"], []),
    }
    if shutil.which("aarch64-linux-gnu-gcc") and shutil.which(QEMU):
        arm = ("aarch64-linux-gnu-gcc", ["-march=armv8-a"], [QEMU, "-L", "/usr/aarch64-linux-gnu"])
        builds["aarch64 NEON"] = arm
    elif os.geteuid() == 0 and shutil.which("apt-get"):  # where the test command installs them
        raise AssertionError("scripts/test.sh installs the cross compiler and qemu as root")
    started = {
        name: _build_harness(tmp_path / f"harness-{i}", compiler, flags)
        for i, (name, (compiler, flags, _)) in enumerate(builds.items())
    }
    outputs = {name: _harness_values(*started[name], builds[name][2]) for name in builds}
    reference = outputs.pop("portable C")
    assert reference.pop("vec_width") == [1]
    for name, values in outputs.items():
        width = values.pop("vec_width")[0]
        assert width == (4 if name == "aarch64 NEON" else native.load().attention_vec_width())
        assert values.keys() == reference.keys(), name
        for case, want in reference.items():
            got = torch.tensor(values[case])
            tol = 1e-2 if case.endswith("_bf16") else 1e-5
            error = ((got - torch.tensor(want)).abs() / (1 + torch.tensor(want).abs())).max()
            assert error <= tol, f"{name}: {case} differs by {float(error):.2e}"
