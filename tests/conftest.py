"""Shared fixtures: real engines on the default model, started once per session.

Every test that uses an engine fixture gets the KV slot accounting checked afterwards
(free + cached + held by requests == pool capacity).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _start_engine(**kwargs):
    import sglite

    return sglite.Engine(dtype="float32", log_level="error", **kwargs)


@pytest.fixture(scope="session")
def engine():
    """The default model in float32 (exact comparisons), radix cache on, a roomy pool."""
    eng = _start_engine(max_total_tokens=16384)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def engine_no_cache():
    """The same model with the radix cache disabled (ablation / reference)."""
    eng = _start_engine(max_total_tokens=16384, disable_radix_cache=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def engine_small_pool():
    """A pool far smaller than the workload: forces eviction, retraction and chunking."""
    eng = _start_engine(max_total_tokens=400, chunked_prefill_size=64, max_running_requests=16)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def engine_no_jump_forward():
    """Constrained decoding token by token (the reference for jump-forward)."""
    eng = _start_engine(max_total_tokens=16384, disable_jump_forward=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def engine_retokenize():
    """SGLang's original jump-forward: forced text appended unverified."""
    eng = _start_engine(max_total_tokens=16384, jump_forward_mode="retokenize")
    yield eng
    eng.shutdown()


ENGINE_FIXTURES = (
    "engine",
    "engine_no_cache",
    "engine_small_pool",
    "engine_no_jump_forward",
    "engine_retokenize",
)


@pytest.fixture(autouse=True)
def _check_kv_invariants(request):
    """After each test, every engine it used must account for every KV slot."""
    yield
    for name in ENGINE_FIXTURES:
        if name in request.fixturenames:
            eng = request.getfixturevalue(name)
            info = eng.check_invariants()
            assert info["held_by_requests"] == 0, f"{name}: requests still hold slots: {info}"


@pytest.fixture(scope="module")
def engine_backend(engine):
    """The language's in-process backend on the session engine."""
    from sglite.lang.backend.engine_backend import EngineBackend

    return EngineBackend(engine)


@pytest.fixture(scope="module")
def endpoint_backend(sglite_server):  # noqa: F811 (the fixture imported below)
    """The language's HTTP backend on the session server."""
    import sglite as sgl

    return sgl.RuntimeEndpoint(sglite_server.url)


@pytest.fixture(params=["engine", "endpoint"])
def backend(request, engine):
    """Each test runs once per backend (`engine` is requested so KV invariants are checked)."""
    return request.getfixturevalue(f"{request.param}_backend")


# The HTTP server fixture (sglite_server) for tests/test_server_*.py lives in server_fixtures.py;
# importing it here registers it once, so the whole session shares one server process.
from server_fixtures import sglite_server  # noqa: E402, F401
