"""Memory of a server's process tree for bench_footprint: RSS, PSS and anonymous RSS summed over
a process and its descendants (from /proc), the machine's available memory, a guard thread that
kills a tree passing the limits, and killing a tree by id."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

GUARD_PERIOD_S = 0.1
GB = 1e9


@dataclass
class TreeMemory:
    """Memory summed over a process and its descendants (bytes)."""

    rss: int
    pss: int
    processes: int
    anon: int = 0  # RssAnon: private memory, not file pages (the mapped GGUF) or shmem


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's `children` file); [] once it is gone."""
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return []
    kids: list[int] = []
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            continue
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (breadth first)."""
    tree, queue = [], [pid]
    while queue:
        p = queue.pop(0)
        if p not in tree:
            tree.append(p)
            queue += children(p)
    return tree


def _kb_field(path: str, name: str) -> int | None:
    """The `name:   N kB` line of a /proc file, in bytes (None if the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def tree_memory(pid: int, pss: bool = True) -> TreeMemory:
    """RSS (`VmRSS`) and PSS (`smaps_rollup`; 0 unless `pss`) summed over `pid`'s process tree.

    PSS walks every mapping of the process (costly on a big one); RSS is a counter.
    """
    rss = pss_sum = anon = n = 0
    for p in process_tree(pid):
        r = _kb_field(f"/proc/{p}/status", "VmRSS")
        if r is None:  # exited meanwhile, or a kernel thread without memory
            continue
        rss += r
        anon += _kb_field(f"/proc/{p}/status", "RssAnon") or 0
        if pss:
            pss_sum += _kb_field(f"/proc/{p}/smaps_rollup", "Pss") or 0
        n += 1
    return TreeMemory(rss, pss_sum, n, anon)


def mem_available() -> int:
    """The machine's MemAvailable in bytes."""
    return _kb_field("/proc/meminfo", "MemAvailable") or 0


class RssGuard(threading.Thread):
    """Samples a process tree's RSS; kills the tree when it passes the limits. Keeps the peak."""

    def __init__(self, pid: int, max_rss: float, min_available: float) -> None:
        super().__init__(daemon=True, name=f"rss-guard-{pid}")
        self.pid, self.max_rss, self.min_available = pid, max_rss, min_available
        self.peak = 0
        self.exceeded = ""
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(GUARD_PERIOD_S):
            rss = tree_memory(self.pid, pss=False).rss
            self.peak = max(self.peak, rss)
            free = mem_available()
            if rss > self.max_rss or free < self.min_available:
                self.exceeded = (
                    f"RSS {rss / GB:.1f} GB > {self.max_rss / GB:.0f} GB"
                    if rss > self.max_rss
                    else f"MemAvailable {free / GB:.1f} GB < {self.min_available / GB:.1f} GB"
                )
                kill_tree(self.pid, signal.SIGKILL)
                return

    def stop(self) -> None:
        """End the sampling."""
        self._done.set()
        self.join()


def kill_tree(pid: int, sig: int) -> None:
    """Send `sig` to `pid` and each of its descendants (by id)."""
    for p in reversed(process_tree(pid)):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
