"""The model process's heap keeps freed activation memory: a second prefill-sized tensor
reuses the first one's pages instead of faulting in fresh zeroed ones."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's policy"
)

PROBE = """
import resource, sys, torch
from sglite.runtime.model.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def touch():
    t = torch.empty(40 << 20, dtype=torch.uint8)
    t.fill_(1)
    del t
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


def test_a_freed_40_mb_tensor_is_reused_without_page_faults():
    pages = (40 << 20) // 4096
    assert _faults("default") > pages // 2  # glibc's default maps fresh pages every time
    assert _faults("keep") < pages // 20
