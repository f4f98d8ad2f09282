"""`sglite router`: parse flags, bind the port, serve until Ctrl-C or SIGTERM.

On the signal the router stops accepting connections, lets requests in flight finish for
`--shutdown-timeout` seconds (their workers keep serving them), then closes its connections
and exits with code 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

import uvicorn

from sglite.http.sockets import bind_socket
from sglite.load_balancing.policy import LOW_MATCH_CHOICES, POLICIES
from sglite.router.app import create_app
from sglite.router.args import LOG_LEVELS, URL_LISTS, RouterArgs, flag
from sglite.router.state import RouterState, build_state

HELP = {
    "worker_urls": "workers (sglite serve) to route to, e.g. http://127.0.0.1:30001",
    "pd_disaggregation": "prefill/decode disaggregation: send each generation request to a "
    "prefill worker (by --policy) and a decode worker (least loaded) at once; the workers are "
    "given as --prefill and --decode",
    "prefill_urls": "with --pd-disaggregation: the prefill workers (sglite serve in prefill mode)",
    "decode_urls": "with --pd-disaggregation: the decode workers (sglite serve in decode mode)",
    "policy": "cache_aware: longest cached prefix unless loads are uneven; round_robin; "
    "least_load: fewest requests in flight",
    "host": "address to listen on",
    "port": "port to listen on (0 = any free port)",
    "cache_threshold": "cache_aware: route by prefix when the best match covers more than this "
    "fraction of the request text",
    "balance_abs_threshold": "cache_aware: loads are uneven when max - min in-flight requests "
    "exceeds this ...",
    "balance_rel_threshold": "... and max exceeds min times this",
    "max_tree_size": "cache_aware: characters of request text remembered per worker",
    "low_match_policy": "cache_aware: where a request without a good prefix match goes: the "
    "worker holding the least text (SGLang router's choice), or the least-loaded one",
    "health_check_interval": "seconds between health checks of each worker",
    "health_check_timeout": "seconds a worker's /health may take",
    "health_failure_threshold": "failed health checks in a row that take a worker out",
    "max_retries": "times a request is re-sent to another worker after a worker failed it",
    "connect_timeout": "seconds to connect to a worker before it is considered down",
    "request_timeout": "seconds a worker may stay silent while generating (then 504)",
    "shutdown_timeout": "seconds requests in flight may run on after SIGTERM",
    "max_request_body_bytes": "larger request bodies are refused with 413",
    "log_level": "debug, info, warning or error",
}


def parse_args(argv: Sequence[str] | None, prog: str) -> RouterArgs:
    """RouterArgs from command-line flags (exits with a usage message on bad values)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Route SGLang native and OpenAI API requests to sglite workers."
    )
    defaults = RouterArgs()
    for f in dataclasses.fields(RouterArgs):
        _add_flag(parser, f.name, getattr(defaults, f.name))
    ns = parser.parse_args(argv)
    args = RouterArgs(**vars(ns))
    try:
        args.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _add_flag(parser: argparse.ArgumentParser, name: str, default: Any) -> None:
    """The flag of RouterArgs field `name`, typed by its default."""
    if name in URL_LISTS:
        # `--prefill A B` and `--prefill A --prefill B` both work (SGLang router repeats it).
        nargs, action = ("*", "store") if name == "worker_urls" else ("+", "extend")
        parser.add_argument(
            flag(name), dest=name, nargs=nargs, action=action, default=[], metavar="URL",
            help=HELP[name],
        )  # fmt: skip
        return
    if isinstance(default, bool):
        parser.add_argument(flag(name), dest=name, action="store_true", help=HELP[name])
        return
    choices = {
        "policy": POLICIES, "log_level": LOG_LEVELS, "low_match_policy": LOW_MATCH_CHOICES
    }.get(name)  # fmt: skip
    parser.add_argument(
        flag(name),
        dest=name,
        type=type(default),
        default=default,
        choices=choices,
        help=f"{HELP[name]} (default: {default})",
    )


class _Server(uvicorn.Server):
    """uvicorn.Server that says when it is ready and how many workers answered."""

    def __init__(self, config: uvicorn.Config, state: RouterState, url: str) -> None:
        super().__init__(config)
        self._state = state
        self._url = url

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(
                f"sglite router is ready: {self._url} (policy {self._state.policy.name}; "
                f"{self._state.health_summary()}; Ctrl-C to stop)",
                flush=True,
            )


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def launch_router(args: RouterArgs) -> int:
    """Serve the router until interrupted; blocks. Returns the exit code (0)."""
    args.validate()
    # uvicorn re-raises the signal that stopped it; SIGTERM's default action would skip the
    # clean-up below, so make it a normal exit.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    sock = bind_socket(args.host, args.port)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"
    try:
        state = build_state(args)
        config = uvicorn.Config(
            create_app(state),
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)),
            timeout_keep_alive=5,
            access_log=level == "DEBUG",
        )
        _Server(config, state, url).run(sockets=[sock])
    finally:
        sock.close()
        print("sglite router: stopped", file=sys.stderr, flush=True)
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "sglite router") -> int:
    """Parse flags and run the router; returns the exit code."""
    args = parse_args(argv, prog)
    try:
        return launch_router(args)
    except KeyboardInterrupt:  # Ctrl-C: already shut down cleanly
        return 0
    except OSError as exc:
        print(f"sglite router: error: {exc}", file=sys.stderr)
        return 1
