"""The C kernels build for the CPUs users have, not only for this host: the portable path
(x86-64 baseline, and aarch64 with a cross compiler), the AVX2 and the AVX-512 paths all compile
without a warning; and a server whose kernels fail to build still serves the same answers."""

from __future__ import annotations

import os
import shutil
import subprocess

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
