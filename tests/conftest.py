"""Shared fixtures: real engines on the default model, started once per session or module.

Every test that uses an engine fixture gets the KV slot accounting checked afterwards
(free + cached + held by requests == pool capacity).
"""

from __future__ import annotations

import ctypes
import gc
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# KV pool of the shared engines: the whole 8192-token context, 377 MB in float32. The engines
# used by one module only are module-scoped, so at most a few are alive at once (CI has 24 GB
# for everything: these, the tests' own servers and models, and pytest).
POOL_TOKENS = 8192


def _start_engine(**kwargs):
    """float32 with the GGUF blocks' float activations: the arithmetic whose greedy tokens the
    tests compare exactly across batches, cache hits and chunks (the int8 activations of x86
    hosts' default round decode-sized products only, so those can differ: docs/deterministic.md;
    tests/test_gguf_activations.py covers them)."""
    import sglite

    kwargs.setdefault("gguf_activations", "float")
    return sglite.Engine(dtype="float32", log_level="error", **kwargs)


@pytest.fixture(scope="session")
def engine():
    """The default model in float32 (exact comparisons), radix cache on, a roomy pool."""
    eng = _start_engine(max_total_tokens=POOL_TOKENS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def engine_no_cache():
    """The same model with the radix cache disabled (ablation / reference)."""
    eng = _start_engine(max_total_tokens=POOL_TOKENS, disable_radix_cache=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine_small_pool():
    """A pool far smaller than the workload: forces eviction, retraction and chunking."""
    eng = _start_engine(max_total_tokens=400, chunked_prefill_size=64, max_running_requests=16)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine_ngram():
    """The default engine with n-gram speculative decoding."""
    # Not adaptive: these tests count drafts, which must not depend on measured step times.
    eng = _start_engine(
        max_total_tokens=POOL_TOKENS, speculative_algorithm="ngram", speculative_adaptive=False
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine_no_jump_forward():
    """Constrained decoding token by token (the reference for jump-forward)."""
    eng = _start_engine(max_total_tokens=POOL_TOKENS, disable_jump_forward=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine_retokenize():
    """SGLang's original jump-forward: forced text appended unverified."""
    eng = _start_engine(max_total_tokens=POOL_TOKENS, jump_forward_mode="retokenize")
    yield eng
    eng.shutdown()


ENGINE_FIXTURES = (
    "engine",
    "engine_no_cache",
    "engine_small_pool",
    "engine_ngram",
    "engine_no_jump_forward",
    "engine_retokenize",
)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module", autouse=True)
def _collect_models_in_cycles():
    """After a module that grew this process by 256 MB or more (it loaded models in-process),
    collect garbage and give freed heap back to the system: models caught in reference cycles
    would otherwise stay until the next full collection, and glibc keeps freed weights' pages
    (~0.5 GB per model), while the suite's processes share 24 GB."""
    if not os.path.exists("/proc/self/statm"):
        yield
        return
    before = _rss_bytes()
    yield
    if _rss_bytes() - before >= 256 << 20:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


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
# The headless browser for the web UI's tests (tests/test_web_ui.py, test_server_lifecycle.py).
from browser_fixtures import browser  # noqa: E402, F401
from server_fixtures import sglite_server  # noqa: E402, F401


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' SmolLM2 from the default model's GGUF (dequantized to float32, eval mode):
    the reference the parity and embedding tests compare with, loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglite.runtime.model.loader import default_model_path

    path = default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied
    return hf.eval()
