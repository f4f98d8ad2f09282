"""Token bitmasks: int32 `[B, ceil(V/32)]`, token t allowed iff bit `t % 32` of word `t // 32`
is set (the layout llguidance and xgrammar both fill)."""

from __future__ import annotations

import torch


def allocate_bitmask(
    batch: int, vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An int32 `[batch, ceil(vocab/32)]` bitmask with every token allowed."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)


def allowed_tokens(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool `[vocab_size]`: the tokens one bitmask row allows."""
    shifts = torch.arange(32, dtype=torch.int32, device=row.device)
    return ((row.unsqueeze(-1) >> shifts) & 1).view(-1)[:vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set disallowed tokens of `logits[rows]` to -inf, in place, in one vectorised op.

    `bitmask` is `[len(rows), words]`: its row i masks logits row `rows[i]`.
    """
    device = logits.device
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    vocab = logits.shape[-1]
    bits = (bitmask.to(device).unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
