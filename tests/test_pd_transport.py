"""The KV hand-off between two schedulers' pools over real ZeroMQ sockets, without a model:
pages arrive bit-exact over TCP and shared memory, holds and slots are released exactly once,
and damaged or late transfers fail naming why (docs/pd.md)."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import zmq
from server_fixtures import free_port

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.disaggregation.decode_side import KVReceiver
from sglite.runtime.disaggregation.messages import Bootstrap, KVDone, KVPages, KVPull
from sglite.runtime.disaggregation.pages import gather_pages, payload_bytes, scatter_pages
from sglite.runtime.disaggregation.prefill_side import KVSender
from sglite.runtime.disaggregation.transport import SharedMemoryTransport
from sglite.runtime.sampling.params import SamplingParams
from sglite.runtime.sampling.request_state import SamplingInfo
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.stats import SchedulerStats

LAYERS, HEADS, DIM, CAPACITY = 3, 2, 4, 64


def pool(dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(CAPACITY, LAYERS, HEADS, DIM, dtype)


def request(rid: str, prompt: list[int]) -> Req:
    """A scheduler request as the receiver sees it (no tokenizer needed on this side)."""
    params = SamplingParams.from_dict({"max_new_tokens": 4})
    sampling = SamplingInfo.create(params, prompt)
    return Req(rid, prompt, params, sampling, None, None, time.monotonic())  # type: ignore[arg-type]


class Prefilled:
    """A request on the prefill side: its prompt's KV (random) in a pool and in the cache,
    locked by the request (`finish` drops that lock, as the scheduler does after a hand-off)."""

    def __init__(self, src: KVPool, cache: RadixCache, prompt: list[int]) -> None:
        self.prompt_ids = prompt
        self.kv_slots = src.alloc(len(prompt))
        for layer in range(LAYERS):
            src.k[layer][self.kv_slots] = torch.randn(len(prompt), HEADS, DIM, dtype=src.dtype)
            src.v[layer][self.kv_slots] = torch.randn(len(prompt), HEADS, DIM, dtype=src.dtype)
        cache.insert(prompt, self.kv_slots)
        match = cache.match_prefix(prompt)
        cache.lock(match.node)
        self.last_node, self.cached_len = match.node, len(prompt)
        self.cache = cache

    def finish(self) -> None:
        self.cache.unlock(self.last_node)


def counters() -> SchedulerStats:
    return SchedulerStats()


def wait_for(receiver: KVReceiver, sender: KVSender, timeout: float = 10.0):
    """Poll both sides until the receiver reports something; its (ready, failed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sender.poll()
        ready, failed = receiver.poll()
        if ready or failed:
            return ready, failed
        time.sleep(0.01)
    raise TimeoutError("nothing arrived")


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_arrive_bit_exact_and_both_sides_are_freed(backend, dtype):
    src, dst = pool(dtype), pool(dtype)
    src_cache, dst_cache = RadixCache(src), RadixCache(dst)
    port = free_port()
    sender = KVSender(src, src_cache, "127.0.0.1", port, 5.0, counters())
    kv = RequestKVManager(dst, dst_cache, cache_enabled=True)
    receiver = KVReceiver(kv, backend, 5.0, counters())
    prompt = list(range(100, 140))
    try:
        # The decode side already caches the prompt's first 10 tokens: only 30 travel.
        own = dst.alloc(10)
        dst_cache.insert(prompt[:10], own)
        req = request("r1", prompt)
        room = Bootstrap("127.0.0.1", port, "room-1")
        receiver.add(req, room)
        receiver.admit(reserved=0)
        assert req.cached_len == 10 and len(req.kv_slots) == 40
        prefilled = Prefilled(src, src_cache, prompt)
        done = KVDone("room-1", len(prompt), first_token=7)
        sender.hand_off("room-1", prefilled, done)
        prefilled.finish()
        assert src_cache.protected_size() == len(prompt)  # held for the decode server
        ready, failed = wait_for(receiver, sender)
        assert failed == [] and ready[0][0] is req and ready[0][1].first_token == 7
        for layer in range(LAYERS):
            assert torch.equal(
                dst.k[layer][req.kv_slots[10:]], src.k[layer][prefilled.kv_slots[10:]]
            )
            assert torch.equal(
                dst.v[layer][req.kv_slots[10:]], src.v[layer][prefilled.kv_slots[10:]]
            )
        assert receiver.stats.disaggregation_transferred_tokens == 30
        assert sender.stats.disaggregation_transfers == 1
        sender.poll()
        assert not sender.busy and src_cache.protected_size() == 0  # the hand-off's lock is gone
        if backend == "shm":
            leftovers = [
                f for f in os.listdir(SharedMemoryTransport().directory) if "sglite-kv" in f
            ]
            assert leftovers == []  # the receiver unlinked what it read
    finally:
        sender.close()
        receiver.close()


def test_a_damaged_payload_fails_the_transfer_and_frees_its_slots():
    dst = pool()
    kv = RequestKVManager(dst, RadixCache(dst), cache_enabled=True)
    receiver = KVReceiver(kv, "tcp", 5.0, counters())
    port = free_port()
    context = zmq.Context()
    fake_prefill = context.socket(zmq.ROUTER)
    fake_prefill.bind(f"tcp://127.0.0.1:{port}")
    try:
        req = request("r2", list(range(20)))
        receiver.add(req, Bootstrap("127.0.0.1", port, "room-2"))
        receiver.admit(reserved=0)
        identity, raw = fake_prefill.recv_multipart()
        pull = pickle.loads(raw)
        assert isinstance(pull, KVPull) and pull.skip == 0 and pull.num_tokens == 20
        payload = bytearray(payload_bytes(dst, 20))
        header = KVPages("room-2", 0, 20, "tcp", {"nbytes": len(payload)}, checksum=12345)
        fake_prefill.send_multipart([identity, pickle.dumps(header), bytes(payload)])
        deadline = time.monotonic() + 10
        failed: list = []
        while not failed and time.monotonic() < deadline:
            _, failed = receiver.poll()
            time.sleep(0.01)
        assert failed[0][0] is req and "checksum mismatch" in failed[0][1]
        kv.discard(req)  # what the scheduler does with a failed transfer
        assert dst.num_free == CAPACITY and not receiver.busy
        # The prefill side is told to drop the room.
        _, raw = fake_prefill.recv_multipart()
        assert pickle.loads(raw).room == "room-2"
    finally:
        receiver.close()
        fake_prefill.close(linger=0)
        context.term()


def test_silence_times_out_on_both_sides():
    src, dst = pool(), pool()
    src_cache = RadixCache(src)
    port = free_port()
    sender = KVSender(src, src_cache, "127.0.0.1", port, 0.3, counters())
    kv = RequestKVManager(dst, RadixCache(dst), cache_enabled=True)
    receiver = KVReceiver(kv, "tcp", 0.3, counters())
    try:
        # The decode side asks a prefill server that never gets the request...
        lonely = request("r3", list(range(12)))
        receiver.add(lonely, Bootstrap("127.0.0.1", port, "never-prefilled"))
        receiver.admit(reserved=0)
        _, failed = wait_for(receiver, sender)
        assert failed[0][0] is lonely and "timed out" in failed[0][1]
        kv.discard(lonely)
        # ... and a prefill server holds pages nobody pulls, until its deadline.
        prefilled = Prefilled(src, src_cache, list(range(30, 50)))
        sender.hand_off("never-pulled", prefilled, KVDone("never-pulled", 20, 1))
        prefilled.finish()
        assert sender.busy
        time.sleep(0.4)
        sender.poll()
        assert not sender.busy and src_cache.protected_size() == 0
        assert sender.stats.disaggregation_failed_transfers == 1
    finally:
        sender.close()
        receiver.close()


def test_a_payload_of_another_shape_is_refused():
    src, dst = pool(), KVPool(CAPACITY, LAYERS + 1, HEADS, DIM, torch.float32)
    slots = src.alloc(5)
    with pytest.raises(ValueError, match="expected"):
        scatter_pages(dst, dst.alloc(5), gather_pages(src, slots))
