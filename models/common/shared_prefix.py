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

``segment_layout`` turns the segments into batched attention calls (segments with the same own and context
lengths batch together, one mask each); ``CoreAttention`` runs them when the model gets ``segments``.
"""

from __future__ import annotations

from collections import defaultdict
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
    """``count`` segments of one own length and one context length, attended in one call."""

    count: int
    length: int
    context_length: int
    queries: torch.Tensor
    """int64 ``[count * length]``: packed positions of the segments' own tokens, segment after segment."""
    keys: torch.Tensor
    """int64 ``[count * (context_length + length)]``: per segment its context's positions, then its own."""
    mask: torch.Tensor | None
    """Boolean ``[length, context_length + length]`` (True = may attend): the whole context, then causal;
    None without context (plain causal attention)."""


@dataclass(frozen=True)
class SegmentLayout:
    """How a packed row's attention runs as batches of segments (``segment_layout``)."""

    batches: list[SegmentBatch]
    scatter: torch.Tensor
    """int64 ``[seqlen]``: for each packed position, its row in the batches' outputs concatenated."""


def segment_layout(segments: list[Segment], seqlen: int) -> SegmentLayout:
    """The batched attention calls of ``segments``, which must cover ``[0, seqlen)`` exactly once (host tensors)."""
    covered = sorted((s.start, s.length) for s in segments)
    assert [a for a, _ in covered] == [0] + [a + n for a, n in covered[:-1]], "segments must tile the row"
    assert covered[-1][0] + covered[-1][1] == seqlen, "segments must cover the row"
    by_shape: dict[tuple[int, int], list[Segment]] = defaultdict(list)
    for s in segments:
        by_shape[(s.length, s.context_length)].append(s)
    batches: list[SegmentBatch] = []
    scatter = torch.empty(seqlen, dtype=torch.long)
    done = 0
    for (length, context), members in sorted(by_shape.items()):
        owns = [torch.arange(s.start, s.start + length) for s in members]
        queries = torch.cat(owns)
        contexts = [torch.arange(s.context_start, s.context_start + context) for s in members]
        keys = torch.cat([torch.cat(pair) for pair in zip(contexts, owns)])
        mask = None
        if context:
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            mask = torch.cat([torch.ones(length, context, dtype=torch.bool), causal], dim=1)
        scatter[queries] = torch.arange(done, done + queries.numel())
        done += queries.numel()
        batches.append(SegmentBatch(len(members), length, context, queries, keys, mask))
    return SegmentLayout(batches, scatter)
