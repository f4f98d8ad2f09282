"""Deterministic inference's forward (docs/deterministic.md).

Every token of every batch (prefill, extend, draft verification, decode) runs as a DECODE row
of the native decode step, in chunks of the most rows it takes: a row attends to its own
sequence's slots up to its position, rows of one sequence go in order and each layer stores
their K/V before attention reads it, so a prompt computed at once, in chunks or after a cached
prefix does the same arithmetic per token. The step runs with `deterministic` set (one GEMM
kernel per weight for every row count, attention in fixed ranges), and the logits come from the
output projection's `matmul_rows`. A row's result then depends on its token and context only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglite.runtime.model import kernels
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
from sglite.runtime.model.linear_weight import LinearWeight
from sglite.runtime.model.native_decode import NativeDecoder

if TYPE_CHECKING:
    from sglite.runtime.cache.kv_pool import KVPool
    from sglite.runtime.model.causal_lm import CausalLM


def check_row_forward(model: CausalLM, decoder: NativeDecoder | None, head: LinearWeight) -> None:
    """Raise ValueError naming why `model` cannot run `forward_rows`."""
    why = None
    probe = torch.zeros(1, model.config.hidden_size, dtype=model.dtype, device=model.device)
    if decoder is None:
        why = "its layers cannot run in the native decode step (CUDA, experts, no compiler?)"
    elif len(decoder.tables) != 1:
        why = "its projections change weights with the batch size (quantized_max_rows)"
    elif decoder.max_rows == 0:
        why = "the native decode step takes none of its rows"
    elif head.matmul_rows(probe) is None:
        why = f"its output projection ({head.kind}) has no row-independent kernel"
    if why is not None:
        raise ValueError(f"enable_deterministic_inference: not for this model: {why}")


def forward_rows(model: CausalLM, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
    """`CausalLM.forward` in deterministic mode (see the module docstring)."""
    decoder = model._decoder()
    assert isinstance(decoder, NativeDecoder) and decoder.deterministic
    residual = model.input_embeddings(batch)
    table = row_slot_table(batch)
    step = decoder.max_rows
    for start in range(0, residual.shape[0], step):
        rows = slice(start, start + step)
        positions, out_slots = batch.positions[rows], batch.out_slots[rows]
        decoder.run_rows(residual[rows], positions, out_slots, table[rows], pool)
    norm = model.norm
    if batch.hidden_rows is not None:
        wanted = residual.index_select(0, batch.hidden_rows)
        batch.hidden = kernels.add_rms_norm(None, wanted, norm.weight, norm.eps).float()
    if batch.logit_rows.numel() == 0:
        return torch.empty(0, model.config.vocab_size, device=model.device)
    h = residual.index_select(0, batch.logit_rows)
    h = kernels.add_rms_norm(None, h, norm.weight, norm.eps)
    logits = model.output_projection().matmul_rows(h)
    assert logits is not None  # checked by check_row_forward
    return logits.float()


def row_slot_table(batch: ForwardBatch) -> torch.Tensor:
    """`[T, W]` int64: row t lists the slots of its token's sequence (it attends to the first
    `positions[t] + 1` of them)."""
    if batch.mode is ForwardMode.DECODE:
        assert batch.padded_slots is not None
        return batch.padded_slots
    width = max(batch.seq_lens)
    table = torch.zeros(batch.input_ids.shape[0], width, dtype=torch.long)
    row = 0
    for slots, extend in zip(batch.kv_slots, batch.extend_lens, strict=True):
        table[row : row + extend, : slots.shape[0]] = slots
        row += extend
    return table.to(batch.input_ids.device)
