"""Packed rows whose sequences share prefixes: each shared prefix is held once, and the sequences' remainders
attend to it.

A microbatch in which several sequences start with the same tokens (GRPO's samples of one prompt) can hold
those tokens once.  The row is then a list of segments: a segment attends to a context segment (all of it)
and causally to its own tokens.  A shared prefix is a segment without context; every sequence's remainder
is a segment whose context is its prefix, at positions continuing the prefix's; a sequence that shares
nothing (and the trailing padding) is a segment without context.  Each token's output equals that of the
unshared packing, while the prefix's forward and backward run once instead of once per sequence (the
gradients of a prefix token sum over the remainders that attend to it, as autograd does through the
gather of its keys and values).

``segment_layout`` turns the segments into a few batched attention calls (segments of similar own and context
lengths, padded to the longest of their batch, as ``packing.padded_groups`` does for plain rows);
``CoreAttention`` runs them when the model gets ``segments``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """A span ``[start, start + length)`` of the packed row attending causally to itself after, in full, the
    context span ``[context_start, context_start + context_length)`` (none when ``context_length`` is 0)."""

    start: int
    length: int
    context_start: int = 0
    context_length: int = 0


@dataclass(frozen=True)
class SegmentBatch:
    """``count`` segments padded to ``length`` own and ``context_length`` context tokens, attended in one call."""

    count: int
    length: int
    context_length: int
    queries: torch.Tensor
    """int64 ``[count * length]``: packed positions of the segments' own tokens, segment after segment (a padded
    slot reads the segment's last token)."""
    keys: torch.Tensor
    """int64 ``[count * (context_length + length)]``: per segment its context's positions, then its own (padded
    slots read a real key, which the mask hides)."""
    mask: torch.Tensor | None
    """Boolean ``[count, 1, length, context_length + length]`` (True = may attend): a segment's context, then
    causal over its own tokens; a padded query row sees what the segment's last token sees (never an empty row,
    whose softmax would be NaN in the backward).  None for unpadded segments without context (plain causal)."""


@dataclass(frozen=True)
class SegmentLayout:
    """How a packed row's attention runs as batches of segments (``segment_layout``)."""

    batches: list[SegmentBatch]
    scatter: torch.Tensor
    """int64 ``[seqlen]``: for each packed position, its row in the batches' outputs concatenated."""


def _fits(shortest: int, longest: int, ratio: float, slack: int) -> bool:
    return longest <= max(ratio * shortest, shortest + slack)


def _batch(members: list[Segment], done: int, scatter: torch.Tensor) -> SegmentBatch:
    """One padded batch of ``members``; writes their tokens' output rows (from ``done`` on) into ``scatter``."""
    # One column per field, members along dim 0: every index below is a broadcast, not a loop over members.
    fields = torch.tensor([(s.start, s.length, s.context_start, s.context_length) for s in members])
    starts, lengths, context_starts, context_lengths = fields.T[:, :, None]
    length, context = int(lengths.max()), int(context_lengths.max())
    slots, context_slots = torch.arange(length), torch.arange(context)
    # A padded slot repeats the segment's last token: its query row sees what that token sees (never an empty row).
    last = slots.minimum(lengths - 1)
    own = starts + last
    # Context slots past a segment's context read its last context token, or without one its last own token.
    has_context = context_lengths > 0
    last_context = torch.where(has_context, context_starts + context_lengths - 1, starts + lengths - 1)
    ctx = torch.where(has_context, (context_starts + context_slots).minimum(last_context), last_context)
    seen_context = (context_slots < context_lengths[:, :, None]).expand(-1, length, -1)
    seen_own = (slots <= last[:, :, None]) & (slots < lengths[:, :, None])
    real = slots < lengths
    scatter[own[real]] = done + torch.arange(len(members) * length).view(len(members), length)[real]
    padded = context > 0 or bool((lengths != length).any())
    mask = torch.cat([seen_context, seen_own], dim=2).unsqueeze(1) if padded else None
    return SegmentBatch(len(members), length, context, own.reshape(-1), torch.cat([ctx, own], dim=1).reshape(-1), mask)


def _runs(items: list[Segment], size: Callable[[Segment], int], ratio: float, slack: int) -> list[list[Segment]]:
    """``items`` sorted by ``size`` and cut greedily into runs whose longest fits their shortest (``_fits``)."""
    runs: list[list[Segment]] = []
    for s in sorted(items, key=lambda s: (size(s), s.start)):
        if runs and _fits(size(runs[-1][0]), size(s), ratio, slack):
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def segment_layout(segments: list[Segment], seqlen: int, ratio: float = 1.25, slack: int = 16) -> SegmentLayout:
    """The batched attention calls of ``segments``, which must cover ``[0, seqlen)`` exactly once (host tensors).

    Segments are cut into runs of similar context length, each run into batches of similar own length, both by
    the ``packing.padded_groups`` rule (the longest within ``max(ratio * shortest, shortest + slack)``): a
    handful of calls however many lengths the completions have, attention at most ``ratio**2`` times the
    unpadded cost (or a few short rows of padding).
    """
    covered = sorted((s.start, s.length) for s in segments)
    assert [a for a, _ in covered] == [0] + [a + n for a, n in covered[:-1]], "segments must tile the row"
    assert covered[-1][0] + covered[-1][1] == seqlen, "segments must cover the row"
    batches: list[SegmentBatch] = []
    scatter = torch.empty(seqlen, dtype=torch.long)
    done = 0
    for run in _runs(segments, lambda s: s.context_length, ratio, slack):
        for members in _runs(run, lambda s: s.length, ratio, slack):
            batch = _batch(members, done, scatter)
            done += batch.count * batch.length
            batches.append(batch)
    return SegmentLayout(batches, scatter)
