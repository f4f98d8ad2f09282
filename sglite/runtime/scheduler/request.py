"""A request as the scheduler tracks it: tokens, KV slots, cache lock, sampling and stop state.

Invariants:
- `fill_ids = prompt_ids + output_ids`; the first `len(kv_slots)` of them have K/V in the pool.
- `kv_slots[:cached_len]` belong to the radix cache (locked through `last_node`); the rest
  belong to this request and must be freed or handed to the cache when it leaves.
- While decoding, exactly one token (the last sampled) lacks K/V: `len(kv_slots) == len(fill) - 1`.
- `kv_slots` changes only by appending, by truncating its tail (then `slot_mirror.truncate`
  is told, as draft verification does), or by being replaced with a new list. `SlotMirror`
  relies on this to keep a tensor copy in step without re-reading the whole list.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sglite.runtime.cache.tree_node import TreeNode
from sglite.runtime.constrained import GrammarMatcher, GrammarTicket
from sglite.runtime.detokenizer import IncrementalDetokenizer, StopChecker
from sglite.runtime.disaggregation.messages import Bootstrap
from sglite.runtime.multimodal.processor import ImageItem, is_pad
from sglite.runtime.sampling.params import SamplingParams
from sglite.runtime.sampling.request_state import SamplingInfo
from sglite.runtime.scheduler.io import GenerateInput, RequestOutput
from sglite.runtime.scheduler.pooling import Pooling
from sglite.runtime.tokenizer import Tokenizer


class SlotMirror:
    """An int64 tensor copy of a request's `kv_slots`, updated by copying only what is new.

    Decode batches need every running request's slots as a tensor each step; converting whole
    lists costs O(context) Python work per request and step (milliseconds for a large batch).
    """

    def __init__(self) -> None:
        self._source: list[int] | None = None
        self._buf = torch.empty(0, dtype=torch.long)
        self._synced = 0

    def truncate(self, n: int) -> None:
        """The list was cut to `n` entries: later entries must be copied again (the slots
        appended after a cut need not be the ones that were cut)."""
        self._synced = min(self._synced, n)

    def view(self, slots: list[int]) -> torch.Tensor:
        """`torch.tensor(slots)`, reusing the entries copied before (see module invariants)."""
        if slots is not self._source:
            self._source, self._synced = slots, 0
        n = len(slots)
        self._synced = min(self._synced, n)
        if n > self._buf.numel():
            grown = torch.empty(max(n, 2 * self._buf.numel(), 64), dtype=torch.long)
            grown[: self._synced] = self._buf[: self._synced]
            self._buf = grown
        if n > self._synced:
            self._buf[self._synced : n] = torch.tensor(slots[self._synced :], dtype=torch.long)
            self._synced = n
        return self._buf[:n]


@dataclass
class Req:
    """One generation request inside the scheduler process (see module invariants)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sampling: SamplingInfo
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    arrival_time: float
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = True  # False: only the first and the final increment are sent
    pooling: Pooling | None = None  # an embedding request
    images: list[ImageItem] = field(default_factory=list)  # in the prompt, in order
    bootstrap: Bootstrap | None = None  # disaggregated: the prefill server and room
    segments: list[tuple[int, int]] = field(default_factory=list)  # reusable prompt spans
    # Past this many tokens the request's KV is approximate (assembled from segments): never
    # inserted into the radix cache. None: all exact.
    exact_len: int | None = None
    segment_counts: dict[str, int] | None = None  # reused / recomputed / computed prompt tokens

    output_ids: list[int] = field(default_factory=list)
    # Constrained decoding: the matcher has consumed exactly `output_ids` (ticket while compiling).
    grammar: GrammarMatcher | None = None
    grammar_ticket: GrammarTicket | None = None
    # Its structure is being closed before the budget runs out (`structure_closing.py`): it
    # ends as cut by length, whatever ends it.
    closing_structure: bool = False
    jump_forward_drafted: int = 0  # forced tokens proposed to the model
    jump_forward_accepted: int = 0  # of those, the ones emitted
    spec_drafted: int = 0  # speculative (n-gram) draft tokens proposed to the model
    spec_accepted: int = 0  # of those, the ones emitted
    spec_verify_ct: int = 0  # forward passes that verified a speculative draft
    kv_slots: list[int] = field(default_factory=list)
    slot_mirror: SlotMirror = field(default_factory=SlotMirror)
    cached_len: int = 0
    last_node: TreeNode | None = None
    cached_tokens: int = 0  # reported: prompt tokens served from the cache at first admission
    # ... and per tier ({"device", "host", "disk"}); `match_split` is the latest match's split.
    cached_tokens_details: dict[str, int] | None = None
    match_split: dict[str, int] = field(default_factory=dict)
    admitted_once: bool = False
    finish_reason: dict[str, Any] | None = None
    output_text: str = ""  # detokenized output after stop trimming
    sent_text_len: int = 0
    sent_token_len: int = 0

    # Logprobs not yet sent to the client.
    input_logprobs_pending: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_pending: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_logprobs_done: bool = False
    output_logprobs_pending: list[tuple[float, int]] = field(default_factory=list)
    output_top_pending: list[list[tuple[float, int]]] = field(default_factory=list)

    @classmethod
    def from_input(cls, inp: GenerateInput, tokenizer: Tokenizer, device: torch.device) -> Req:
        """The request for `inp`, its sampling state on `device`; raises ValueError for invalid
        sampling parameters (the client validated them already)."""
        params = SamplingParams.from_dict(inp.sampling_params)
        # Image positions' pad ids are not tokens: penalties and detokenizing skip them.
        tokens = [t for t in inp.input_ids if not is_pad(t)] if inp.images else inp.input_ids
        return cls(
            rid=inp.rid,
            prompt_ids=list(inp.input_ids),
            params=params,
            sampling=SamplingInfo.create(params, list(tokens), device),
            detokenizer=IncrementalDetokenizer(
                tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                # Context so SentencePiece-style tokenizers keep the first output's leading space.
                prompt_ids=tokens,
            ),
            stop_checker=StopChecker(params.stop, params.stop_regex),
            arrival_time=inp.arrival_time or time.monotonic(),
            return_logprob=inp.return_logprob,
            logprob_start_len=inp.logprob_start_len,
            top_logprobs_num=inp.top_logprobs_num,
            stream=inp.stream,
            pooling=Pooling(inp.pooling) if inp.pooling else None,
            images=list(inp.images),
            bootstrap=inp.bootstrap,
            segments=[(int(a), int(b)) for a, b in inp.segments],
        )

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose K/V the request needs: prompt then generated output."""
        return self.prompt_ids + self.output_ids

    @property
    def num_fill(self) -> int:
        """len(fill_ids) without building the list."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        """Output tokens this request may still generate (for memory reservation)."""
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    @property
    def wants_input_logprobs(self) -> bool:
        """True while the prompt's logprobs (from logprob_start_len) still need computing."""
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None

    def take_output(self) -> RequestOutput:
        """What changed since the last call; text that may still become a stop string is held
        back until the request finishes."""
        text = self.output_text
        safe = (
            len(text) if self.finished else len(text) - self.stop_checker.partial_suffix_len(text)
        )
        safe = max(safe, self.sent_text_len)
        out = RequestOutput(
            rid=self.rid,
            new_token_ids=self.output_ids[self.sent_token_len :],
            new_text=text[self.sent_text_len : safe],
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens,
            cached_tokens_details=self.cached_tokens_details,
            completion_tokens=len(self.output_ids),
            jump_forward_drafted=self.jump_forward_drafted,
            jump_forward_accepted=self.jump_forward_accepted,
            spec_drafted=self.spec_drafted,
            spec_accepted=self.spec_accepted,
            spec_verify_ct=self.spec_verify_ct,
            segment_tokens=self.segment_counts,
        )
        self.sent_text_len, self.sent_token_len = safe, len(self.output_ids)
        if self.finished and self.pooling is not None and self.pooling.count:
            out.embedding = self.pooling.embedding()
        if self.return_logprob:
            if self.input_logprobs_pending:
                out.input_token_logprobs = self.input_logprobs_pending
                out.input_top_logprobs = self.input_top_pending
                self.input_logprobs_pending, self.input_top_pending = [], []
            out.output_token_logprobs = self.output_logprobs_pending
            out.output_top_logprobs = self.output_top_pending
            self.output_logprobs_pending, self.output_top_pending = [], []
        return out
