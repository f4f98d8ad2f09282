"""Fuzz the live HTTP server through its own OpenAPI schema (schemathesis).

Every documented operation gets schema-driven requests, valid and invalid (schemathesis' examples,
coverage and fuzzing phases). Each answer must be no 5xx, arrive within a timeout (no hang), and
match what the schema says for its status: the status is documented, the content type is
documented, the body (JSON, or each server-sent event of a stream) validates, and invalid input is
refused with a 4xx. Afterwards the server must still be healthy and account for every KV slot.

Generation is bounded so the whole module runs in about two minutes on a 2-core CPU (about
2,000 requests): requests are clamped to a few new tokens and few samples before they are sent
(see `_clamp`). No documented route is excluded: none shuts the server down, and /flush_cache
only empties the cache (it is refused while other requests run).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from sglite.runtime.server.native_protocol import MAX_N

pytestmark = pytest.mark.slow  # about two minutes

# Most new tokens one fuzz case may ask for. The coverage phase sends hundreds of boundary-value
# cases per generating route, so each gets one token (one forward pass: prefill and sampling);
# the random fuzzing phase gets a few, enough for decode steps, stops and multi-event streams.
COVERAGE_NEW_TOKENS = 1
FUZZING_NEW_TOKENS = 4
MAX_SAMPLES = 2  # `n` / samples per prompt
# Seconds one request may take before it counts as a hang (a few tokens take well under a
# second; grammars compile in the scheduler within --grammar-compile-timeout = 10 s).
REQUEST_TIMEOUT = 30.0
MAX_EXAMPLES = 4  # per operation, fuzzing phase (the examples and coverage phases add more)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]

# Fuzz cases sent, per operation and per (phase, positive/negative) (reported at the end).
CASES: Counter[str] = Counter()
PHASES: Counter[str] = Counter()

# Fields whose value sets how many tokens the scheduler generates.
_TOKEN_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "max_output_tokens")


@pytest.fixture(scope="module")
def api_schema(sglite_server: Any) -> schemathesis.BaseSchema:
    """The live server's own schema, as served at /openapi.json."""
    schema = schemathesis.openapi.from_url(sglite_server.url + "/openapi.json")
    schema.config.update(base_url=sglite_server.url, request_timeout=REQUEST_TIMEOUT)
    schema.config.output.sanitization.update(enabled=False)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def _clamp_sampling(params: dict[str, Any], default_key: str, budget: int) -> None:
    """Cap token budgets and sample counts in one sampling dict, in place.

    Only values the schema accepts are changed (too large but valid), so an invalid case stays
    invalid and `negative_data_rejection` still applies. A missing budget gets one: the defaults
    (128 tokens natively, the rest of the context for chat) would take minutes per case.
    """
    for key in _TOKEN_FIELDS:
        value = params.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > budget:
            params[key] = budget
    if all(params.get(key) is None for key in _TOKEN_FIELDS):
        params[default_key] = budget
    n = params.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and MAX_SAMPLES < n <= MAX_N:
        params["n"] = MAX_SAMPLES


def _clamp(case: schemathesis.Case) -> None:
    """Bound the generation work of a case before it is sent."""
    body = case.body
    if not isinstance(body, dict):
        return
    coverage = case.meta is not None and case.meta.phase.name.value == "coverage"
    budget = COVERAGE_NEW_TOKENS if coverage else FUZZING_NEW_TOKENS
    if case.path == "/generate":
        params = body.get("sampling_params")
        if params is None:  # null or missing: the defaults would generate 128 tokens
            body["sampling_params"] = params = {}
        for p in params if isinstance(params, list) else [params]:
            if isinstance(p, dict):
                _clamp_sampling(p, "max_new_tokens", budget)
    elif case.path in ("/v1/completions", "/v1/chat/completions"):
        _clamp_sampling(body, "max_tokens", budget)
    elif case.path == "/v1/responses":
        _clamp_sampling(body, "max_output_tokens", budget)


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_schema(case: schemathesis.Case) -> None:
    """Each schema-generated request: no 5xx, no hang, and an answer the schema documents."""
    _clamp(case)
    CASES[f"{case.method} {case.path}"] += 1
    if case.meta is not None:
        PHASES[f"{case.meta.phase.name.value}/{case.meta.generation.mode.value}"] += 1
    case.call_and_validate(checks=CHECKS)


def test_server_survives_fuzzing(sglite_server: Any, record_property: Any) -> None:
    """After the fuzzing: healthy, idle within a few seconds, every KV slot accounted for, no
    cache lock left behind (a flush succeeds), and still generating."""
    url = sglite_server.url
    assert requests.get(url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while True:
        info = requests.get(url + "/get_server_info", timeout=30).json()
        idle = info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
        if idle and info["num_in_flight_reqs"] == 0:
            break
        assert time.monotonic() < deadline, f"requests still running after fuzzing: {info}"
        time.sleep(0.2)
    inv = info["kv_invariants"]
    assert inv["ok"] is True, inv
    assert inv["held_by_requests"] == 0, inv
    assert inv["free"] + inv["cached"] == info["max_total_num_tokens"], inv
    # A request the scheduler lost would still hold its cached prefix locked: flushing the
    # cache refuses while any node is locked, so a clean flush means nothing leaked.
    r = requests.post(url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    inv = requests.get(url + "/get_server_info", timeout=30).json()["kv_invariants"]
    assert inv["ok"] is True and inv["cached"] == 0, inv
    assert inv["free"] == info["max_total_num_tokens"], inv
    r = requests.post(
        url + "/generate",
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    spec = requests.get(url + "/openapi.json", timeout=30).json()
    methods = {"get", "post", "put", "patch", "delete"}
    routes = {f"{m.upper()} {p}" for p, item in spec["paths"].items() for m in item if m in methods}
    assert routes - set(CASES) == set(), "documented routes the fuzzer did not reach"
    record_property("fuzz_cases", sum(CASES.values()))
    print(
        f"\nfuzz cases sent: {sum(CASES.values())} ({dict(sorted(PHASES.items()))}) over "
        f"{len(CASES)} method/path pairs"
    )
