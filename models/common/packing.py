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


def positions_from_cu_seqlens(
    cu_seqlens: torch.Tensor, seqlen: int, device: torch.device | None = None
) -> torch.Tensor:
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


def segment_lengths(cu_seqlens: torch.Tensor, seqlen: int) -> list[int]:
    """Length of every non-empty segment of a row of ``seqlen`` tokens, the trailing padding included.

    A host list (one device sync where ``cu_seqlens`` lives on an accelerator); empty
    sequences (repeated entries) are dropped.
    """
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if seqlen > bounds[-1]:
        lengths.append(seqlen - bounds[-1])
    return lengths


def equal_length_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """``lengths`` as ``(count, length)`` runs of consecutive equal lengths: ``[4, 4, 2] -> [(2, 4), (1, 2)]``."""
    runs: list[tuple[int, int]] = []
    for n in lengths:
        if runs and runs[-1][1] == n:
            runs[-1] = (runs[-1][0] + 1, n)
        else:
            runs.append((1, n))
    return runs


def pad_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``cu_seqlens`` extended to ``length`` entries by repeating its last one (empty sequences)."""
    if length < cu_seqlens.numel():
        raise ValueError(f"cannot pad cu_seqlens of {cu_seqlens.numel()} entries down to {length}")
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(length - cu_seqlens.numel())])
