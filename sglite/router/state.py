"""What one router owns (`RouterState`) and how it is built from `RouterArgs`.

Outside PD mode there is one group of workers, all alike. In PD mode there are two, the prefill
and the decode workers, each with its own registry and health checks: generation requests go to
one worker of each (sglite/router/pd.py), every other forwarded route to a decode worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from sglite.http.errors import APIError
from sglite.load_balancing.policy import CacheAware, LeastLoad, Policy, make_policy
from sglite.router.args import RouterArgs
from sglite.router.bootstrap import DECODE, PREFILL, ROLES, RoleCheck
from sglite.router.forward import Forwarder
from sglite.router.metrics import RouterMetrics
from sglite.router.pd import PDForwarder
from sglite.router.workers import Worker, WorkerGroup, WorkerRegistry


@dataclass
class RouterState:
    """Everything one router owns; `app.state.router` holds it.

    Invariant: `registry` is the group that serves the forwarded non-generation routes (every
    worker, or the decode workers in PD mode) and `forwarder` forwards over it; `groups` lists
    every registry once; `pd` is set iff `args.pd_disaggregation`.
    """

    args: RouterArgs
    client: httpx.AsyncClient
    registry: WorkerRegistry
    policy: Policy  # routes generation requests (to the prefill workers in PD mode)
    forwarder: Forwarder
    metrics: RouterMetrics
    groups: list[WorkerGroup]
    pd: PDForwarder | None = None

    def tree_size(self, url: str) -> int:
        """Items the cache_aware tree attributes to `url` (0 for other policies)."""
        return tree_size_of(self.policy, url)

    def describe(self, worker: Worker, role: str | None = None) -> dict[str, Any]:
        """A worker as /list_workers shows it (with its `role` in PD mode)."""
        described = {
            "url": worker.url,
            "healthy": worker.healthy,
            "load": worker.in_flight,
            "routed": worker.routed,
            "retries": worker.retries,
            "tree_size": self.tree_size(worker.url),
            "decisions": dict(worker.decisions),
            "last_error": worker.last_error,
        }
        return described | ({"role": role} if role else {})

    def describe_all(self) -> list[dict[str, Any]]:
        """Every worker of every group, described."""
        return [self.describe(w, g.role) for g in self.groups for w in g.registry.all_workers()]

    def group(self, role: str | None) -> WorkerGroup:
        """The group `?role=` names for /add_worker and /remove_worker; APIError 400 naming
        `role` if PD mode needs one and it is missing or unknown (or given outside PD mode)."""
        if self.pd is None:
            if role:
                raise APIError(400, "role: only with --pd-disaggregation", param="role")
            return self.groups[0]
        for group in self.groups:
            if role and group.role == role:
                return group
        message = f"role: give the worker's role as &role={' or &role='.join(ROLES)}"
        raise APIError(400, message + (f" (got {role!r})" if role else ""), param="role")

    def owner(self, url: str) -> WorkerGroup | None:
        """The group `url` (normalised) is registered in, if any."""
        return next((g for g in self.groups if g.registry.get(url) is not None), None)

    def health_summary(self) -> str:
        """ "1/2 workers healthy", or per role in PD mode."""
        parts = []
        for g in self.groups:
            up, total = len(g.registry.healthy_workers()), len(g.registry.all_workers())
            parts.append(f"{up}/{total} {g.role + ' ' if g.role else ''}workers healthy")
        return ", ".join(parts)


def tree_size_of(policy: Policy, url: str) -> int:
    """Items `policy`'s tree attributes to `url` (0 for policies without a tree)."""
    return policy.tree.size(url) if isinstance(policy, CacheAware) else 0


def build_state(args: RouterArgs) -> RouterState:
    """The router's parts for `args` (validated); workers start down until checked."""
    args.validate()
    policy = make_policy(args.policy, args.cache_aware_config())
    client = _client(args)
    if args.pd_disaggregation:
        return _pd_state(args, client, policy)
    registry = _registry(args, client, policy.forget, args.worker_urls)
    forwarder = Forwarder(registry, policy, client, args.max_retries)
    groups = [WorkerGroup(None, registry)]
    metrics = RouterMetrics(groups, lambda url: tree_size_of(policy, url))
    return RouterState(args, client, registry, policy, forwarder, metrics, groups)


def _pd_state(args: RouterArgs, client: httpx.AsyncClient, policy: Policy) -> RouterState:
    """Two groups: prefill workers routed by `policy`, decode workers by load. A worker gets
    traffic only once its /get_server_info shows its group's role (RoleCheck.admit)."""
    prefill_roles = RoleCheck(client, PREFILL, args.health_check_timeout)
    decode_roles = RoleCheck(client, DECODE, args.health_check_timeout)

    def prefill_down(url: str) -> None:
        policy.forget(url)
        prefill_roles.forget(url)

    prefill = _registry(args, client, prefill_down, args.prefill_urls, prefill_roles)
    decode = _registry(args, client, decode_roles.forget, args.decode_urls, decode_roles)
    # No retries for prefill copies (PDForwarder sends each once); the decode forwarder also
    # serves the passthrough routes, which keep their retries.
    pd = PDForwarder(
        Forwarder(prefill, policy, client, max_retries=0),
        Forwarder(decode, LeastLoad(), client, args.max_retries),
        prefill_roles,
    )
    groups = [WorkerGroup(PREFILL, prefill), WorkerGroup(DECODE, decode)]
    metrics = RouterMetrics(groups, lambda url: tree_size_of(policy, url))
    return RouterState(args, client, decode, policy, pd.decode, metrics, groups, pd)


def _client(args: RouterArgs) -> httpx.AsyncClient:
    timeout = httpx.Timeout(
        connect=args.connect_timeout, read=args.request_timeout,
        write=args.request_timeout, pool=args.request_timeout,
    )  # fmt: skip
    # Idle connections are dropped well before a worker's own 5 s keep-alive ends, so the router
    # rarely sends on a socket the worker is closing (which would look like a failed worker).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


def _registry(
    args: RouterArgs,
    client: httpx.AsyncClient,
    on_down: Callable[[str], None],
    urls: list[str],
    roles: RoleCheck | None = None,
) -> WorkerRegistry:
    registry = WorkerRegistry(
        client,
        health_timeout=args.health_check_timeout,
        failure_threshold=args.health_failure_threshold,
        on_down=on_down,
        admit=roles.admit if roles else None,
    )
    for url in urls:
        registry.add(url)
    return registry
