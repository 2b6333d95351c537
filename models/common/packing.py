"""Helpers for one packed row of several sequences described by ``cu_seqlens``.

``cu_seqlens`` is int32 ``[n_seqs + 1]``: ``0, len0, len0 + len1, ...``.  Tokens past
``cu_seqlens[-1]`` (padding at the end of a row) form one extra sequence of their own, so
they never attend to, or are attended by, real tokens.  Repeated trailing entries are empty
sequences and change nothing, which lets rows with different sequence counts share one
``cu_seqlens`` length (``pad_cu_seqlens``).
"""

from __future__ import annotations

import torch


def segment_ids(cu_seqlens: torch.Tensor, seqlen: int, device: torch.device | None = None) -> torch.Tensor:
    """Sequence index of every token of the row, ``[seqlen]`` int64."""
    device = device if device is not None else cu_seqlens.device
    idx = torch.arange(seqlen, device=device)
    return torch.searchsorted(cu_seqlens[1:].to(device=device, dtype=torch.int64), idx, right=True)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, seqlen: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions that restart at 0 at every sequence start, ``[1, seqlen]`` int64."""
    device = device if device is not None else cu_seqlens.device
    seg = segment_ids(cu_seqlens, seqlen, device)
    starts = cu_seqlens.to(device=device, dtype=torch.int64)
    return (torch.arange(seqlen, device=device) - starts[seg]).unsqueeze(0)


def packed_causal_mask(cu_seqlens: torch.Tensor, seqlen: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean block-diagonal causal mask ``[seqlen, seqlen]``, True where attention is allowed."""
    device = device if device is not None else cu_seqlens.device
    seg = segment_ids(cu_seqlens, seqlen, device)
    idx = torch.arange(seqlen, device=device)
    return (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])


def pad_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``cu_seqlens`` extended to ``length`` entries by repeating its last one (empty sequences)."""
    if length < cu_seqlens.numel():
        raise ValueError(f"cannot pad cu_seqlens of {cu_seqlens.numel()} entries down to {length}")
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(length - cu_seqlens.numel())])
