"""The CPU's instruction-set features, read from /proc/cpuinfo (empty where it is not there)."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` line of /proc/cpuinfo (x86), or an empty set."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles for bf16 (oneDNN's GEMMs and attention use them)."""
    return "amx_bf16" in cpu_flags()
