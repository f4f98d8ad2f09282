"""What the scheduler reports: the live statistics of get_server_info (`scheduler_info`: the
table, the pool and cache, the counters, the tiers, speculation, images, disaggregation) and the
web UI's bounded snapshot of the radix tree (`cache_tree`). Read-only: nothing here changes the
scheduler's state.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from sglite.runtime.cache.tiered_cache import TieredRadixCache
from sglite.runtime.cache.tree_view import snapshot_tree
from sglite.runtime.multimodal.processor import is_pad
from sglite.runtime.scheduler.request_table import ReqStatus
from sglite.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from sglite.runtime.scheduler.scheduler import Scheduler


def cache_tree(sched: Scheduler, depth: int, max_nodes: int, text_tokens: int) -> dict[str, Any]:
    """A bounded snapshot of the radix tree (`cache/tree_view.py`) with the path the latest
    admitted request matched, and the live statistics (`info`)."""
    last = sched.kv.last_admission
    decode = lambda ids: _decode_span(sched.tokenizer, ids)
    tree = snapshot_tree(
        sched.cache,
        decode,
        depth=depth,
        max_nodes=max_nodes,
        text_tokens=text_tokens,
        highlight=None if last is None else last.node,
    )
    request = None
    if last is not None:
        request = {
            "rid": last.rid,
            "cached_tokens": last.cached_tokens,
            "prompt_tokens": last.prompt_tokens,
            "segment_tokens": last.segments,
        }
    return {**tree, "last_request": request, "stats": scheduler_info(sched)}


def scheduler_info(sched: Scheduler) -> dict[str, Any]:
    """Live statistics for get_server_info."""
    stats = sched.cache.stats
    queried = max(1, stats.queried_tokens)
    used = sched.pool.capacity - sched.pool.num_free
    running = sched.table.count(ReqStatus.RUNNING) + sched.table.count(ReqStatus.CHUNKED)
    return {
        "num_running_reqs": running,
        "num_queued_reqs": sched.table.count(ReqStatus.WAITING),
        "max_total_num_tokens": sched.pool.capacity,
        "num_free_slots": sched.pool.num_free,
        "cache_size_tokens": sched.cache.total_size(),
        "pool_usage": used / sched.pool.capacity,
        "cache_hit_rate": stats.matched_tokens / queried,
        "cached_prompt_tokens": stats.matched_tokens,
        "evicted_tokens": stats.evicted_tokens,
        "queried_prompt_tokens": stats.queried_tokens,
        "new_token_ratio": sched.budget.ratio,
        **sched.stats.as_dict(),
        **_tier_info(sched),
        **_speculation_info(sched),
        **_huge_page_info(sched),
        **(sched.vision.info() if sched.vision is not None else {}),
        **(sched.disagg.info() if sched.disagg is not None else {}),
    }


def _speculation_info(sched: Scheduler) -> dict[str, Any]:
    speculator, costs = sched.decode.speculator, sched.decode.spec_costs
    return {
        **(speculator.info() if speculator is not None else {}),
        **({"speculative_costs": costs.info()} if costs is not None else {}),
    }


def _huge_page_info(sched: Scheduler) -> dict[str, Any]:
    """How far the weights' move into 2 MB pages has come (`run_background_work`)."""
    move = sched.huge_pages
    if move is None:
        return {}
    return {"weights_huge_pages": {"moved_bytes": move.moved, "pending": move.pending}}


def _tier_info(sched: Scheduler) -> dict[str, Any]:
    """Per-tier sizes and counters of the hierarchical cache (docs/hicache.md)."""
    if not isinstance(sched.cache, TieredRadixCache):
        return {}
    return {"hicache": sched.cache.tier_info(), "hicache_costs": sched.cache.costs.snapshot()}


def _decode_span(tokenizer: Tokenizer, ids: list[int]) -> str:
    """A tree node's text: its tokens decoded, each run of image positions (pad ids,
    multimodal/processor.py) shown as `[image]`."""
    return "".join(
        "[image]" if pad else tokenizer.decode(list(run))
        for pad, run in itertools.groupby(ids, key=is_pad)
    )
