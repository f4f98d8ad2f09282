"""The model process's heap keeps freed activation memory: a prefill-sized tensor allocated
again reuses freed pages instead of faulting in fresh zeroed ones."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from sglite.runtime.model.host_memory import heap_environment
from sglite.runtime.scheduler_client import scheduler_environment

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
for _ in range(6):
    touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    """Page faults of six 40 MB tensors after a first, in a process with the default heap or
    with the model process's policy and environment (the scheduler's)."""
    env = scheduler_environment() if mode == "keep" else {**os.environ, "GLIBC_TUNABLES": ""}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env
    )
    return int(out.stdout.split()[-1])


def test_a_freed_40_mb_tensor_is_reused_without_page_faults():
    """Six more 40 MB tensors after a first: glibc's default maps and faults fresh pages for
    each; kept, the heap's pages serve them (a small allocation can split a freed block once,
    so one more block may be faulted in, not six)."""
    pages = (40 << 20) // 4096
    assert _faults("default") > 5 * pages
    assert _faults("keep") < 2 * pages


def test_the_model_process_keeps_users_glibc_tunables():
    """The heap policy's tunable is added to a user's, and a user's own choice of it stands."""
    env = heap_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"
    mine = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}
    assert heap_environment(mine) == mine
