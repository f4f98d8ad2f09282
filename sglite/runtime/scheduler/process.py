"""Entry point of the scheduler process: load the model, then loop receive -> step -> send.

Started by `SchedulerClient` as `python -m sglite.runtime.scheduler.process <json-args>` (a fresh
interpreter, so user scripts need no `if __name__ == "__main__"` guard). It never outlives its
parent: the kernel kills it when the parent dies (PR_SET_PDEATHSIG) and a watchdog thread exits
when the parent pid changes, for platforms without prctl.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import zmq

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

logger = logging.getLogger("sglite.scheduler")


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watchdog() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watchdog, daemon=True, name="parent-watchdog").start()


@contextlib.contextmanager
def _long_lived_heap() -> Iterator[None]:
    """Start-up without the cyclic collector: torch's modules and then the model make a large
    heap that lives as long as the process, and full collections triggered while it grows walk
    all of it and free nothing (a few tenths of a second of start-up). On leaving, what start-up
    left unreachable is collected once and everything else is frozen (kept out of later scans,
    which would otherwise walk it every few steps); call `gc.freeze()` inside to move what exists
    so far (the imported modules) out of that final collection too."""
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


def _handle_control(scheduler: Any, msg: ControlInput) -> ControlOutput:
    try:
        if msg.kind == "flush_cache":
            scheduler.flush_cache()
            value = True
        elif msg.kind == "get_info":
            value = scheduler.info()
        elif msg.kind == "check_invariants":
            value = scheduler.check_invariants()
        elif msg.kind == "cache_tree":
            value = scheduler.cache_tree(**msg.args)
        else:
            raise ValueError(f"unknown control request {msg.kind!r}")
        return ControlOutput(token=msg.token, ok=True, value=value)
    except Exception as exc:  # reported to the caller, the loop keeps serving
        return ControlOutput(token=msg.token, ok=False, error=f"{type(exc).__name__}: {exc}")


def _load(args: ServerArgs, rank: int) -> tuple[Any, Any]:
    """Join the tensor-parallel group (when there is one) and load this rank's model."""
    import torch

    from sglite.runtime.distributed.parallel import init_tensor_parallel
    from sglite.runtime.model.host_memory import keep_freed_memory
    from sglite.runtime.model.load_options import resolve_dtype
    from sglite.runtime.model.loader import load_model

    keep_freed_memory()
    torch.set_num_threads(args.resolved_num_threads())
    torch.manual_seed(args.random_seed)
    tp = init_tensor_parallel(rank, args.tp_size, args.dist_init_addr or "", args.device)
    deterministic = args.enable_deterministic_inference
    packing = args.gemm_packing
    if deterministic and resolve_dtype(args.dtype, args.device) != torch.float32:
        packing = "off"  # bf16's packed layouts are oneDNN's, whose rows depend on the batch
    loaded = load_model(
        args.model_path,
        args.dtype,
        args.device,
        args.tokenizer_path,
        progress=rank == 0,
        quantization=args.quantization,
        quantized_max_rows=-1 if deterministic else args.quantized_max_rows,
        gemm_packing=packing,
        tp=tp,
        gguf_activations=args.gguf_activations,
        mmap_weights=args.mmap_weights,
        batch_invariant=deterministic,
    )
    if deterministic:
        loaded.model.enable_deterministic()
    return tp, loaded


def run_follower(args: ServerArgs, rank: int, parent_pid: int) -> None:
    """A tensor-parallel rank other than 0: hold a shard, run every forward rank 0 broadcasts.

    The collectives here pair one to one with rank 0's: the pool capacity broadcast and the
    weight-size gather at start-up (`Scheduler.__init__`, `run_scheduler`), then one batch
    broadcast per forward, and None to stop.
    """
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    with _long_lived_heap():
        import torch

        from sglite.runtime.cache.kv_pool import KVPool

        gc.freeze()
        tp, loaded = _load(args, rank)
        cfg = loaded.config
        capacity = tp.broadcast_object()
        pool = KVPool(
            capacity, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, loaded.device
        )
        tp.gather_object(loaded.model.weight_bytes())
    if loaded.huge_pages is not None:  # waiting in a broadcast, it has no idle moments to use
        loaded.huge_pages.run_in_background()
    with torch.inference_mode():
        while True:
            batch = tp.broadcast_object()
            if batch is None:
                return
            loaded.model(batch, pool)


def run_scheduler(
    args: ServerArgs, in_addr: str, out_addr: str, parent_pid: int, rank: int = 0
) -> None:
    """Load the model and serve requests until a shutdown control message arrives."""
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the parent owns shutdown and tells us over ZMQ.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(in_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(out_addr)
    try:
        with _long_lived_heap():
            import torch

            from sglite.runtime.model.kernels import native
            from sglite.runtime.model.kernels import native_available as native_kernels_available
            from sglite.runtime.scheduler.scheduler import Scheduler

            gc.freeze()
            tp, loaded = _load(args, rank)
            scheduler = Scheduler(args, loaded, tp)
            weight_bytes = tp.gather_object(loaded.model.weight_bytes())
    except Exception as exc:
        send.send_pyobj(ReadyMessage(ok=False, error=f"{type(exc).__name__}: {exc}"))
        time.sleep(0.2)
        return
    cfg = loaded.config
    send.send_pyobj(
        ReadyMessage(
            ok=True,
            info={
                "model_path": loaded.model_path,
                "dtype": str(loaded.dtype).replace("torch.", ""),
                "device": str(loaded.device),
                "context_length": scheduler.context_len,
                "max_total_num_tokens": scheduler.pool.capacity,
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "architecture": cfg.arch,
                "grammar_backend": args.grammar_backend,
                "jump_forward": scheduler.jump_forward,
                "quantization": loaded.quantization,  # auto resolved
                "activations": loaded.activations,  # GGUF blocks: int8 or float
                "quantized_max_rows": loaded.quantized_max_rows,  # resolved (-1: no dense copy)
                "native_kernels": native_kernels_available(),
                "kernel_isa": native.isa(),  # what the native kernels were built for
                "weight_layouts": loaded.model.weight_layouts(),
                "num_threads": torch.get_num_threads(),
                "tp_size": tp.size,
                "weight_bytes_per_rank": weight_bytes,
                # What the HTTP process applies to its tokenizer, which it loads from the
                # files alone (without torch): the family's stop tokens and chat template.
                SERVED_TOKENS: {
                    "eos_token_ids": list(loaded.tokenizer.eos_token_ids),
                    "chat_template": loaded.tokenizer.chat_template,
                },
            },
        )
    )
    _loop(scheduler, recv, send)
    for sock in (recv, send):
        sock.close(linger=5000)  # deliver what is queued
    ctx.term()


def _loop(scheduler: Any, recv: zmq.Socket, send: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    disagg = scheduler.disagg
    while True:
        busy = scheduler.has_work or scheduler.has_background_work
        timeout = 0 if busy else 1000
        if disagg is not None:
            # Sockets to prefill servers appear as requests name them.
            for sock in disagg.sockets():
                poller.register(sock, zmq.POLLIN)
            timeout = 0 if busy else (10 if disagg.busy else 1000)
        while dict(poller.poll(timeout)).get(recv):
            msg = recv.recv_pyobj()
            timeout = 0
            if isinstance(msg, GenerateInput):
                try:
                    scheduler.add_request(msg)
                except Exception as exc:  # a bad request must not take the scheduler down
                    send.send_pyobj(_error_output(msg.rid, exc))
            elif isinstance(msg, AbortInput):
                scheduler.abort(msg.rid, msg.message, msg.kind)
            elif isinstance(msg, ControlInput):
                if msg.kind == "shutdown":
                    scheduler.abort_all("the server is shutting down", AbortKind.UNAVAILABLE)
                    send.send_pyobj(BatchOutput(scheduler.collect_outputs()))
                    if disagg is not None:
                        disagg.close()
                    scheduler.stop_followers()
                    send.send_pyobj(ControlOutput(token=msg.token, ok=True))
                    return
                send.send_pyobj(_handle_control(scheduler, msg))
        if disagg is not None:
            disagg.poll()
        if not scheduler.has_work:
            scheduler.run_background_work()
            outs = scheduler.collect_outputs()  # e.g. requests rejected at admission
            if outs:
                send.send_pyobj(BatchOutput(outs))
            continue
        try:
            outs = scheduler.step()
        except Exception:
            logger.error("scheduler step failed:\n%s", traceback.format_exc())
            outs = scheduler.fail_all("internal error in the scheduler step")
        if outs:
            send.send_pyobj(BatchOutput(outs))
        scheduler.run_background_work()


def _error_output(rid: str, exc: Exception) -> BatchOutput:
    """The answer to a request the scheduler could not take (its parameters were invalid)."""
    reason = abort_reason(f"{type(exc).__name__}: {exc}", AbortKind.REJECTED)
    return BatchOutput(
        [RequestOutput(rid=rid, new_token_ids=[], new_text="", finish_reason=reason)]
    )


def main() -> None:
    """`python -m sglite.runtime.scheduler.process ARGS_JSON IN_ADDR OUT_ADDR PARENT_PID` (rank
    0), or `... --follower ARGS_JSON RANK PARENT_PID` (another tensor-parallel rank)."""
    if sys.argv[1] == "--follower":
        args = ServerArgs(**json.loads(sys.argv[2]))
        run_follower(args, int(sys.argv[3]), int(sys.argv[4]))
    else:
        args = ServerArgs(**json.loads(sys.argv[1]))
        run_scheduler(args, sys.argv[2], sys.argv[3], int(sys.argv[4]))
    # Skip the interpreter's teardown (unloading torch and friends), which the parent would
    # wait for: everything is sent and nothing else needs flushing. A follower's would also
    # destroy its process group's threads after rank 0, which hosts the group's store, has
    # exited, and C++ then terminates the process ("terminate called without an active
    # exception"): a non-zero exit after a clean stop.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
