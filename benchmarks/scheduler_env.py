"""The scheduler process's OpenMP setting, for benchmarks that drive a model in this process:
import this module before anything that loads torch (libgomp reads the setting as it loads).

A server's scheduler runs with `GOMP_SPINCOUNT` set (`scheduler_client.scheduler_environment`):
libgomp's default spinning after each parallel region steals the core the kernels' own thread
pool needs, which slows some kernels more than others (the int8 GEMV's passes of one or two
rows ~15%, the tiled VNNI GEMM's not), so a comparison of kernels in another setting can rank
them otherwise than the server would.
"""

from __future__ import annotations

import os

from sglite.runtime.scheduler_client import GOMP_SPINCOUNT

os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
