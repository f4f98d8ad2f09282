"""What one forward pass computes: the contract between the scheduler and the model.

A batch is either EXTEND (prefill of each sequence's uncached suffix, attending to its cached
prefix) or DECODE (one new token per sequence). Tokens of all sequences are flattened into one
dimension of length T = sum(extend_lens).

Invariants:
- `prefix_lens[i] + extend_lens[i] == seq_lens[i]`; in DECODE mode every `extend_lens[i] == 1`.
- `kv_slots[i]` (EXTEND only; DECODE uses `padded_slots`) lists the pool slots of all
  `seq_lens[i]` tokens of sequence i in order; its last `extend_lens[i]` entries are where this
  pass writes the new tokens' K/V (`out_slots`). A `scattered` batch (`build_rows`: one
  sequence whose new tokens sit at increasing `positions` anywhere in it, the other slots
  holding K/V already) writes at those positions' slots instead; a token attends to the slots
  up to its position.
- `logit_rows` indexes rows of the flattened T tokens whose logits are returned, in order;
  `hidden_rows` (optional) those whose final hidden states (after the final norm, float32) the
  model stores in `hidden` (embeddings).
- `input_embeds` rows lie within the flattened T tokens and do not overlap.
- `padded_slots`/`padded_mask` describe the *decode-like* sequences: every sequence in DECODE
  mode; in EXTEND mode (a decode step verifying jump-forward drafts) the sequences listed in
  `decode_seqs`, those with one new token after a cached prefix, which attention then serves
  in one batched call instead of one call per sequence. Their token rows are `decode_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from sglite.runtime.cache.kv_pool import KVPool


class ForwardMode(Enum):
    """EXTEND: several new tokens per sequence; DECODE: exactly one."""

    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    """Inputs of one batched forward over the paged KV pool (see module docstring)."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    out_slots: torch.Tensor  # [T] int64, pool slot receiving each token's K/V
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    kv_slots: list[torch.Tensor]  # per sequence, [seq_len] int64 slots (prefix + new)
    logit_rows: torch.Tensor  # [R] int64 rows of T whose logits are wanted
    # DECODE only: padded [B, max_len] slot table (pad = slot 0) and [B, max_len] bool validity.
    padded_slots: torch.Tensor | None = None
    padded_mask: torch.Tensor | None = None
    # EXTEND only: indices of single-token sequences batched like DECODE, and their token rows.
    decode_seqs: list[int] | None = None
    decode_rows: torch.Tensor | None = None
    # Rows whose final hidden states are wanted, and where the model puts them ([H, hidden]).
    hidden_rows: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    # EXTEND only: ([n] rows, [n, hidden] embeddings) replacing those rows' token embeddings
    # (image features; `multimodal/vision_encoder.py`).
    input_embeds: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # EXTEND only: the new tokens sit at `positions` inside the sequence (see `build_rows`).
    scattered: bool = False

    @property
    def decode_seq_lens(self) -> list[int]:
        """Lengths of the sequences the padded table describes."""
        if self.decode_seqs is None:
            return self.seq_lens
        return [self.seq_lens[i] for i in self.decode_seqs]

    @property
    def batch_size(self) -> int:
        """Number of sequences in the batch."""
        return len(self.seq_lens)

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        token_ids: list[list[int]],
        prefix_lens: list[int],
        kv_slots: list[list[int]],
        logit_rows: list[int],
        device: torch.device | str = "cpu",
        slot_tensors: list[torch.Tensor] | None = None,
    ) -> ForwardBatch:
        """Assemble a batch from python lists: `token_ids[i]` are sequence i's new tokens.

        `slot_tensors[i]`, when given, holds `kv_slots[i]` as an int64 CPU tensor already; the
        padded decode table is then built from those without converting lists.
        """
        extend_lens = [len(t) for t in token_ids]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        flat_ids = [t for seq in token_ids for t in seq]
        positions = [p for pre, e in zip(prefix_lens, extend_lens) for p in range(pre, pre + e)]
        out_slots = [s for slots, e in zip(kv_slots, extend_lens) for s in slots[len(slots) - e :]]
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        decode = mode is ForwardMode.DECODE
        batch = cls(
            mode=mode,
            input_ids=as_long(flat_ids),
            positions=as_long(positions),
            out_slots=as_long(out_slots),
            prefix_lens=list(prefix_lens),
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            # DECODE reads only the padded table: skip a second conversion of every slot list.
            kv_slots=[] if decode else [as_long(s) for s in kv_slots],
            logit_rows=as_long(logit_rows),
        )
        table_seqs = (
            range(len(seq_lens)) if decode else _single_token_seqs(extend_lens, prefix_lens)
        )
        if table_seqs:
            # One conversion for the whole table; the mask follows from the lengths.
            width = max(seq_lens[i] for i in table_seqs)
            if slot_tensors is not None:
                rows = [slot_tensors[i] for i in table_seqs]
                table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
                batch.padded_slots = table.to(device)
            else:
                padded = [kv_slots[i] + [0] * (width - len(kv_slots[i])) for i in table_seqs]
                batch.padded_slots = as_long(padded)
            lengths = as_long([seq_lens[i] for i in table_seqs])
            batch.padded_mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
        if not decode and table_seqs:
            starts = [0]
            for e in extend_lens[:-1]:
                starts.append(starts[-1] + e)
            batch.decode_seqs = list(table_seqs)
            batch.decode_rows = as_long([starts[i] for i in table_seqs])
        return batch


def build_decode_rows(
    feeds: list[tuple[list[int], int, list[int], torch.Tensor]],
    logit_rows: list[int],
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Sequences' new tokens as a DECODE batch of one row per token, in order. Each feed is
    (its tokens, the position of the first, the sequence's slots through the last new token,
    those slots as an int64 CPU tensor). Row i of a sequence attends to its slots up to its
    own, and every row's K/V is written before any row's attention reads the pool (in each
    layer), so a token sees the ones before it, as in an EXTEND, on the decode path (on CPU
    the whole pass in one native call: far cheaper for a few rows than an EXTEND through the
    layers one operation at a time). The rows' tables are views of each feed's tensor."""
    tokens, positions, slots, tables = [], [], [], []
    for ids, start, seq_slots, table in feeds:
        for i, token in enumerate(ids):
            end = start + i + 1
            tokens.append([token])
            positions.append(end - 1)
            slots.append(seq_slots[:end])
            tables.append(table[:end])
    return ForwardBatch.build(
        ForwardMode.DECODE, tokens, positions, slots, logit_rows, device, slot_tensors=tables
    )


def build_rows(
    token_ids: list[int],
    positions: list[int],
    kv_slots: torch.Tensor,
    logit_rows: list[int],
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """A scattered EXTEND batch (see the module docstring): one sequence of `len(kv_slots)`
    tokens whose tokens at increasing `positions` (`token_ids`) are computed in one pass, as a
    prefill computes them, attending to every slot up to their position; the other slots'
    K/V are read as they are. The last position must be the sequence's last."""
    if not positions or positions[-1] != kv_slots.shape[0] - 1:
        raise ValueError("a rows batch ends at its sequence's last position")
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    slots = kv_slots.to(device)
    rows = as_long(positions)
    n, total = len(positions), int(kv_slots.shape[0])
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=as_long(token_ids),
        positions=rows,
        out_slots=slots.index_select(0, rows),
        prefix_lens=[total - n],
        extend_lens=[n],
        seq_lens=[total],
        kv_slots=[slots],
        logit_rows=as_long(logit_rows),
        scattered=True,
    )


class RowNarrowing(Protocol):
    """Chooses, layer by layer, which rows of a forward go on (`CausalLM.forward_narrowing`)."""

    def before_layer(self, layer: int, batch: ForwardBatch, pool: KVPool) -> None:
        """Called before `layer` runs over `batch` (the pool holds the K/V it will replace)."""

    def after_layer(self, layer: int, batch: ForwardBatch, pool: KVPool) -> torch.Tensor | None:
        """After `layer` wrote `batch`'s K/V: the rows to keep (ascending, logit rows among
        them), or None to keep all."""


def narrow_rows(batch: ForwardBatch, keep: torch.Tensor) -> ForwardBatch:
    """The rows `keep` (ascending indices into `batch`'s rows, every logit row among them) of a
    one-sequence EXTEND batch, as a scattered batch: each kept token is computed at its
    position, attending to the slots up to it, as before."""
    if batch.mode is not ForwardMode.EXTEND or batch.batch_size != 1 or batch.input_embeds:
        raise ValueError("only a one-sequence EXTEND batch without image rows can be narrowed")
    if not torch.isin(batch.logit_rows, keep).all():
        raise ValueError("a narrowed batch keeps every logit row")
    n, total = int(keep.numel()), batch.seq_lens[0]
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=batch.input_ids.index_select(0, keep),
        positions=batch.positions.index_select(0, keep),
        out_slots=batch.out_slots.index_select(0, keep),
        prefix_lens=[total - n],
        extend_lens=[n],
        seq_lens=[total],
        kv_slots=batch.kv_slots,
        logit_rows=torch.searchsorted(keep, batch.logit_rows),
        scattered=True,
    )


def _single_token_seqs(extend_lens: list[int], prefix_lens: list[int]) -> list[int]:
    """EXTEND sequences worth batching like DECODE: one new token after a cached prefix, when
    there are at least two of them (one alone gains nothing)."""
    seqs = [i for i, (e, p) in enumerate(zip(extend_lens, prefix_lens)) if e == 1 and p > 0]
    return seqs if len(seqs) >= 2 else []
