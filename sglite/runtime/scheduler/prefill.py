"""The layout of a prefill pass, and the prompt logprobs read back from its logits.

A prefill computes a chunk of each admitted request's uncached tokens. Only some positions get
logits, as the output projection over the vocabulary is the costliest matmul of a long chunk:
the last prompt token (to sample the first output token from) and, when input logprobs are
wanted, prompt positions from `logprob_start_len`. Embedding requests also want hidden rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglite.runtime.multimodal.processor import is_pad
from sglite.runtime.sampling.sampler import Sampler
from sglite.runtime.scheduler.request import Req


def logit_offsets(req: Req, start: int, n: int) -> list[int]:
    """Offsets within the chunk `[start, start + n)` whose logits are needed, ascending: input
    logprobs, then the last token when it ends the prompt and output is wanted."""
    rows: list[int] = []
    if req.wants_input_logprobs:
        lo = max(start, req.logprob_start_len)
        hi = min(start + n, len(req.prompt_ids) - 1)
        rows.extend(p - start for p in range(lo, hi))
    end = start + n
    if end == req.num_fill and req.params.max_new_tokens > 0:
        rows.append(n - 1)
    return rows


@dataclass
class PrefillItem:
    """One request's chunk in a `PrefillBatch`."""

    req: Req
    start: int  # first position computed in this pass
    n: int  # tokens computed in this pass
    first_row: int  # its first row of the logits
    offsets: list[int]  # `logit_offsets(req, start, n)`: its rows of the logits, in order
    hidden: tuple[int, int]  # its rows [lo, hi) of the gathered hidden states

    @property
    def last_row(self) -> int:
        """The logits row of the chunk's last wanted position (the one sampled from)."""
        return self.first_row + len(self.offsets) - 1


@dataclass
class PrefillBatch:
    """What an EXTEND pass over admitted chunks computes.

    Built before the forward, while each request's `kv_slots` already end with the chunk's
    slots; nothing the layout reads changes until the pass's outputs are appended.
    """

    token_ids: list[list[int]]
    prefix_lens: list[int]
    logit_rows: list[int]
    hidden_rows: list[int]
    items: list[PrefillItem]
    num_tokens: int

    @classmethod
    def plan(cls, batch: list[tuple[Req, int]]) -> PrefillBatch:
        """Lay out `(request, tokens in this pass)` pairs in order."""
        out = cls([], [], [], [], [], 0)
        for req, n in batch:
            start = len(req.kv_slots) - n
            out.token_ids.append(req.fill_ids[start : start + n])
            out.prefix_lens.append(start)
            offsets = logit_offsets(req, start, n)
            pooled = req.pooling.offsets(start, n, req.num_fill) if req.pooling else []
            hidden = (len(out.hidden_rows), len(out.hidden_rows) + len(pooled))
            out.items.append(PrefillItem(req, start, n, len(out.logit_rows), offsets, hidden))
            out.logit_rows.extend(out.num_tokens + i for i in offsets)
            out.hidden_rows.extend(out.num_tokens + i for i in pooled)
            out.num_tokens += n
        return out


def collect_input_logprobs(item: PrefillItem, logits: torch.Tensor, sampler: Sampler) -> None:
    """Append the chunk's prompt logprobs to `item.req`'s pending ones.

    The token at `logprob_start_len` gets None, as in SGLang (the range's first logprob is not
    computed); the logits at position p score prompt token p + 1.
    """
    req, start, n = item.req, item.start, item.n
    prompt = req.prompt_ids
    s = req.logprob_start_len
    if start <= s < start + n:
        req.input_logprobs_pending.append((None, prompt[s]))
        req.input_top_pending.append(None)
    positions = [start + r for r in item.offsets if start + r < len(prompt) - 1]
    if not positions:
        return
    sub = logits[item.first_row : item.first_row + len(positions)]
    # An image position's pad id (negative) is no token: its logprob is None.
    targets = [prompt[p + 1] for p in positions]
    targets_t = torch.tensor([0 if is_pad(t) else t for t in targets], device=sub.device)
    values, tops = sampler.logprobs_of(sub, targets_t, req.top_logprobs_num)
    for i, target in enumerate(targets):
        req.input_logprobs_pending.append((None if is_pad(target) else values[i], target))
        req.input_top_pending.append(tops[i] if tops is not None else None)
