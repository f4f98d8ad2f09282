"""Start the HTTP server: load the model, bind the port, serve until Ctrl-C or SIGTERM.

Shutdown order matters for "nothing lost, no orphan, no hang": on the signal, new requests get
503 while those in flight run on for `--graceful-shutdown-timeout` seconds; then the rest are
aborted (streams end with an error event, others with 503), uvicorn finds its connections idle and
stops, and only then is the scheduler process stopped and reaped. A second signal aborts at once.
If the scheduler process dies, the server restarts it (`--restart-on-failure`) or exits with 1.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from typing import Any

from sglite.http.sockets import bind_socket
from sglite.runtime.data_parallel import create_client
from sglite.runtime.scheduler_client import launch_followers, local_ranks, stop_processes
from sglite.runtime.server_args import ServerArgs

logger = logging.getLogger("sglite.runtime.server")


def compute_path(info: dict) -> str:
    """The weights' format and the activations' path the scheduler chose, for the start-up
    line (e.g. "weights q4_k+q6_k, activations int8 on avx2_fma")."""
    isa = "+".join(info.get("kernel_isa") or []) or "portable C"
    return (
        f"weights {info.get('quantization', 'none')}, "
        f"activations {info.get('activations', 'float')} on {isa}"
    )


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_worker_node(args: ServerArgs) -> int:
    """A node other than 0 of a multi-node tensor-parallel group: run its ranks, no HTTP.

    Returns when they exit (node 0 stopped them) or on SIGTERM / Ctrl-C (they are stopped).
    """
    ranks = local_ranks(args)
    print(
        f"sglite: node {args.node_rank}/{args.nnodes}: tensor-parallel ranks {ranks} joining "
        f"{args.dist_init_addr}",
        file=sys.stderr,
        flush=True,
    )
    followers = launch_followers(args, ranks)
    try:
        codes = [proc.wait() for proc in followers]
    except (KeyboardInterrupt, SystemExit):
        codes = [0]
    finally:
        stop_processes(followers)
    return 0 if all(code == 0 for code in codes) else 1


def launch_server(args: ServerArgs) -> int:
    """Serve `args.model_path` over HTTP until interrupted; blocks. Returns the exit code:
    0 after SIGTERM / Ctrl-C, 1 when the scheduler died and was not restarted.

    SIGTERM and Ctrl-C stop it gracefully; the scheduler process never outlives it.
    """
    args.validate()
    # uvicorn re-raises the signal that stopped it once it is done; SIGTERM's default action
    # would kill the process before the clean-up below, so make it a normal exit.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node_rank > 0:
        return run_worker_node(args)
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{port}"
    what = args.model_path or "the default model (SmolLM2-135M-Instruct)"
    print(f"sglite: loading {what} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        # The scheduler loads the model while this process imports the HTTP side.
        client = create_client(args, wait=False)
        try:
            import uvicorn

            from sglite.runtime.server.app import create_app
            from sglite.runtime.server.http_server import CONNECTION_CLOSE_GRACE, HTTPServer
            from sglite.runtime.server.state import build_state
        except BaseException:
            client.shutdown()
            raise
        state = build_state(args, client)
    except BaseException:
        sock.close()
        raise
    loaded_in = time.perf_counter() - t0
    print(
        f"sglite: model loaded in {loaded_in:.1f} s ({compute_path(client.info)})",
        file=sys.stderr,
        flush=True,
    )
    try:
        app = create_app(state)
        config = uvicorn.Config(
            app,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=int(args.graceful_shutdown_timeout) + CONNECTION_CLOSE_GRACE,
            timeout_keep_alive=5,
            access_log=level in ("DEBUG", "INFO"),
        )
        server = HTTPServer(config, state, url)
        server.run(sockets=[sock])
    finally:
        state.shutdown()
        sock.close()
        print("sglite: stopped", file=sys.stderr, flush=True)
    if state.exit_code:
        reason = state.client.death_reason or "the scheduler process died"
        print(f"sglite: error: {reason}; exiting", file=sys.stderr, flush=True)
    return state.exit_code
