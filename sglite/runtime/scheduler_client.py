"""Client side of the scheduler process: start it, send it messages, route its answers.

The scheduler runs in a child interpreter (`python -m sglite.runtime.scheduler.process`) so model
compute never holds this process's GIL. A receiver thread reads its `BatchOutput`s and hands each
request's increment to the callback registered for that request id.

Invariants: every registered request gets exactly one increment with a finish reason, also when
the scheduler process dies (then the reason is an abort naming the failure). An unexpected death
is reported once to `on_death` (on the receiver thread), after those aborts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from sglite.runtime.model.host_memory import heap_environment
from sglite.runtime.scheduler.io import (
    SERVED_TOKENS,
    AbortInput,
    AbortKind,
    BatchOutput,
    ControlInput,
    ControlOutput,
    GenerateInput,
    ReadyMessage,
    RequestOutput,
    abort_reason,
)
from sglite.runtime.server_args import ServerArgs

OutputCallback = Callable[[RequestOutput], None]


# libgomp's idle threads spin ~300k rounds before sleeping by default; between torch's ops and
# the native kernels (own thread pool) that spinning takes the cores the kernels need. 20k keeps
# torch's threads warm across back-to-back ops (a small decode step issues many in a row) yet lets
# them sleep before a native kernel needs their cores. A value the user set wins.
GOMP_SPINCOUNT = "20000"


def scheduler_environment() -> dict[str, str]:
    """The scheduler process's environment: ours, plus OpenMP tuning unless set already and
    the model process's heap policy (`host_memory.heap_environment`)."""
    env = dict(os.environ)
    env.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    return heap_environment(env)


def free_port() -> int:
    """A free TCP port on the loopback interface (for the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_ranks(args: ServerArgs) -> list[int]:
    """The tensor-parallel ranks this node runs (node 0's first one is rank 0)."""
    per_node = args.tp_size // args.nnodes
    first = args.node_rank * per_node
    return list(range(first, first + per_node))


def launch_followers(args: ServerArgs, ranks: list[int]) -> list[subprocess.Popen]:
    """Start scheduler processes for tensor-parallel ranks other than 0."""
    payload = json.dumps(dataclasses.asdict(args))
    module = "sglite.runtime.scheduler.process"
    return [
        subprocess.Popen(
            [sys.executable, "-m", module, "--follower", payload, str(rank), str(os.getpid())],
            env=scheduler_environment(),
        )
        for rank in ranks
    ]


def stop_processes(processes: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """Terminate processes (follower ranks), killing any that do not exit in time."""
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in processes:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class SchedulerDiedError(RuntimeError):
    """The scheduler process exited; requests in flight end with this error."""


class SchedulerClient:
    """Owns the scheduler child process and the ZeroMQ sockets to it."""

    def __init__(self, args: ServerArgs, startup_timeout: float = 600.0, wait: bool = True) -> None:
        """Start the scheduler process(es); with `wait`, also wait until they are ready (else
        call `wait_ready`). Processes are started from the calling thread on purpose: the
        kernel's parent-death signal fires when the *thread* that started a child exits."""
        if args.tp_size > 1 and not args.dist_init_addr:
            args = dataclasses.replace(args, dist_init_addr=f"127.0.0.1:{free_port()}")
        self.args = args
        self._tmpdir = tempfile.mkdtemp(prefix="sglite-")
        self._ctx = zmq.Context()
        in_addr = f"ipc://{self._tmpdir}/in"
        out_addr = f"ipc://{self._tmpdir}/out"
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.bind(in_addr)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.bind(out_addr)
        self._send_lock = threading.Lock()
        self._callbacks: dict[str, OutputCallback] = {}
        self._controls: dict[int, Future] = {}
        self._tokens = itertools.count(1)
        self._shutdown_token = 0
        self._lock = threading.Lock()
        self.alive = False
        self.death_reason: str | None = None
        # Told (once, on the receiver thread) when the process dies without being shut down.
        self.on_death: Callable[[str], None] | None = None
        payload = json.dumps(dataclasses.asdict(args))
        cmd = [sys.executable, "-m", "sglite.runtime.scheduler.process", payload]
        self.process = subprocess.Popen(
            cmd + [in_addr, out_addr, str(os.getpid())], env=scheduler_environment()
        )
        # The other tensor-parallel ranks of this node (rank 0 is the process above).
        self.followers = launch_followers(args, local_ranks(args)[1:])
        self.info: dict[str, Any] = {}
        self._thread: threading.Thread | None = None  # the receiver, once ready
        self._startup_timeout = startup_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the scheduler reports ready (raises, cleaning up, if it fails)."""
        try:
            self.info = self._wait_ready(self._startup_timeout)
            self.served_tokens: dict[str, Any] = self.info.pop(SERVED_TOKENS, {})
        except Exception:
            stop_processes(self.followers)
            raise
        self.alive = True
        self._thread = threading.Thread(target=self._receive_loop, daemon=True, name="sched-recv")
        self._thread.start()

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._recv.poll(200):
                msg = self._recv.recv_pyobj()
                if isinstance(msg, ReadyMessage):
                    if not msg.ok:
                        self._cleanup()
                        raise RuntimeError(f"the scheduler failed to start: {msg.error}")
                    return msg.info
            if self.process.poll() is not None:
                self._cleanup()
                raise RuntimeError(
                    f"the scheduler process exited during start-up (code {self.process.returncode})"
                )
        self.process.kill()
        self._cleanup()
        raise TimeoutError(f"the scheduler did not become ready within {timeout:.0f} s")

    @property
    def healthy(self) -> bool:
        """True while the scheduler process runs; notices a death before the receiver does."""
        return self.alive and self.process.poll() is None

    # ------------------------------------------------------------------ sending
    def submit(self, inp: GenerateInput, callback: OutputCallback) -> None:
        """Send a request; `callback` receives each of its increments (on the receiver thread)."""
        if not self.alive:
            raise SchedulerDiedError(self.death_reason or "the scheduler is not running")
        with self._lock:
            self._callbacks[inp.rid] = callback
        self._send_obj(inp)

    def abort(
        self,
        rid: str,
        message: str = "aborted by the client",
        kind: AbortKind = AbortKind.CANCELLED,
    ) -> None:
        """Ask the scheduler to stop a request and free its KV slots."""
        if self.alive:
            self._send_obj(AbortInput(rid=rid, message=message, kind=kind))

    def control(self, kind: str, timeout: float = 60.0, **args: Any) -> Any:
        """Run a control request (flush_cache, get_info, check_invariants) and wait for it."""
        if not self.alive:
            raise SchedulerDiedError(self.death_reason or "the scheduler is not running")
        token = next(self._tokens)
        fut: Future = Future()
        with self._lock:
            self._controls[token] = fut
            if kind == "shutdown":  # its answer is the scheduler's last message
                self._shutdown_token = token
        self._send_obj(ControlInput(kind=kind, token=token, args=args))
        out: ControlOutput = fut.result(timeout)
        if not out.ok:
            raise RuntimeError(out.error)
        return out.value

    def _send_obj(self, obj: Any) -> None:
        with self._send_lock:
            self._send.send_pyobj(obj)

    # ------------------------------------------------------------------ receiving
    def _receive_loop(self) -> None:
        while self.alive:
            if not self._recv.poll(500):
                if self.process.poll() is not None:
                    reason = f"the scheduler process exited (code {self.process.returncode})"
                    stop_processes(self.followers)  # they would wait for rank 0 forever
                    self._on_death(reason)
                    if self.on_death is not None:
                        self.on_death(reason)
                    return
                continue
            try:
                msg = self._recv.recv_pyobj()
            except zmq.ZMQError:
                return
            if isinstance(msg, BatchOutput):
                for out in msg.outputs:
                    self._dispatch(out)
            elif isinstance(msg, ControlOutput):
                with self._lock:
                    fut = self._controls.pop(msg.token, None)
                if fut is not None:
                    fut.set_result(msg)
                if msg.token == self._shutdown_token:
                    return  # nothing follows: do not wait for the next poll to time out

    def _dispatch(self, out: RequestOutput) -> None:
        with self._lock:
            callback = self._callbacks.get(out.rid)
            if out.finish_reason is not None:
                self._callbacks.pop(out.rid, None)
        if callback is not None:
            callback(out)

    def _on_death(self, reason: str) -> None:
        self.alive = False
        self.death_reason = reason
        with self._lock:
            callbacks, self._callbacks = self._callbacks, {}
            controls, self._controls = self._controls, {}
        for rid, callback in callbacks.items():
            abort = abort_reason(reason, AbortKind.UNAVAILABLE)
            callback(RequestOutput(rid=rid, new_token_ids=[], new_text="", finish_reason=abort))
        for token, fut in controls.items():
            fut.set_result(ControlOutput(token=token, ok=False, error=reason))

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the scheduler (in-flight requests end with an abort) and reap the process."""
        if self.process.poll() is None and self.alive:
            try:
                self.control("shutdown", timeout=timeout)
            except Exception:
                pass
        elif self.process.poll() is None:  # still loading (never ready): nothing to drain
            self.process.terminate()
        was_alive, self.alive = self.alive, False
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        stop_processes(self.followers, timeout)
        if was_alive:
            self._on_death("the engine was shut down")
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=2)
        self._cleanup()

    def _cleanup(self) -> None:
        for sock in (self._send, self._recv):
            sock.close(linger=0)
        self._ctx.term()
        for name in ("in", "out"):
            try:
                os.unlink(os.path.join(self._tmpdir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._tmpdir)
        except OSError:
            pass
