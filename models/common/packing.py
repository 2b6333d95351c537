"""Helpers for one packed row of several sequences described by ``cu_seqlens``.

``cu_seqlens`` is int32 ``[n_seqs + 1]``: ``0, len0, len0 + len1, ...``.  Tokens past
``cu_seqlens[-1]`` (padding at the end of a row) form one extra sequence of their own, so
they never attend to, or are attended by, real tokens.  Repeated trailing entries are empty
sequences and change nothing, which lets rows with different sequence counts share one
``cu_seqlens`` length (``pad_cu_seqlens``).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class PaddedGroups:
    """A packed row's segments regrouped into padded batches, one causal attention call each.

    Group ``g`` holds ``counts[g]`` segments padded to ``lengths[g]`` tokens; ``gather`` lists,
    group after group, the packed token each padded slot reads (a slot past its segment's end
    reads the segment's last token), and ``scatter`` gives each packed token its slot.
    """

    counts: list[int]
    lengths: list[int]
    gather: torch.Tensor
    scatter: torch.Tensor


def padded_groups(
    lengths: list[int], device: torch.device, ratio: float = 1.25, slack: int = 16
) -> PaddedGroups | None:
    """Segments of ``lengths`` (in row order) grouped by length for batched causal attention.

    Sorted by length, a segment joins the current group while the group's longest stays within
    ``max(ratio * shortest, shortest + slack)``: attention costs at most ``ratio**2`` times the
    sum of squared lengths (or a few short rows of padding), while a batch of short sequences
    of mixed lengths becomes one call instead of one per sequence.  Padding is causal-safe: a
    real token attends only to earlier tokens of its own segment, and padded slots' outputs
    are dropped.  ``None`` when every segment has the same length (the row is already a batch).
    """
    if len(set(lengths)) <= 1:
        return None
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    counts: list[int] = []
    widths: list[int] = []
    gather: list[int] = []
    scatter = [0] * sum(lengths)
    first = 0
    while first < len(order):
        shortest = lengths[order[first]]
        limit = max(ratio * shortest, shortest + slack)
        last = first
        while last + 1 < len(order) and lengths[order[last + 1]] <= limit:
            last += 1
        width = lengths[order[last]]
        for seg in order[first : last + 1]:
            start, n = starts[seg], lengths[seg]
            base = len(gather)
            scatter[start : start + n] = range(base, base + n)
            gather.extend(range(start, start + n))
            gather.extend([start + n - 1] * (width - n))
        counts.append(last - first + 1)
        widths.append(width)
        first = last + 1
    return PaddedGroups(
        counts,
        widths,
        torch.tensor(gather, dtype=torch.long, device=device),
        torch.tensor(scatter, dtype=torch.long, device=device),
    )


def pad_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``cu_seqlens`` extended to ``length`` entries by repeating its last one (empty sequences)."""
    if length < cu_seqlens.numel():
        raise ValueError(f"cannot pad cu_seqlens of {cu_seqlens.numel()} entries down to {length}")
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(length - cu_seqlens.numel())])
