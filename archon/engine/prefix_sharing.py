"""Prompts shared by several sequences of a microbatch, packed once (``actor.archon.prefix_sharing``).

GRPO samples ``n_samples`` completions of every prompt, so a microbatch holds each prompt that many times.
With prefix sharing the packed row holds it once: sequences whose tokens before their first loss token
are the same form a group; the group's prefix (those tokens but the last) is one segment, and each
sequence's remainder (the last prompt token, then the completion) a segment that attends to the prefix,
at the positions it has in the plain packing (``models/common/shared_prefix.py``).  Every token then has
the hidden state it has in the plain packing, so the engine maps the model's outputs back through
``expand`` and the loss, the logprobs and the gradients are those of the plain packing; the model runs on
fewer tokens.  The last prompt token stays with every remainder because its output predicts the first
completion token, which differs between the remainders.
"""

from __future__ import annotations

import math

import torch

from archon.config import TrainEngineConfig
from archon.engine.errors import EngineError
from archon.engine.microbatch import Batch, PackedMicrobatch, SharedPacking, seqlens_of
from models.common.shared_prefix import Segment, segment_layout
from parallel.dims import ParallelDims

MIN_SHARED_TOKENS = 2
"""Shorter prefixes are not shared (a segment of its own costs an attention call for little)."""


def check_prefix_sharing(config: TrainEngineConfig, parallel_dims: ParallelDims, is_moe: bool, name: str) -> None:
    """Raise when ``archon.prefix_sharing`` is on where this engine cannot share prefixes."""
    if not config.archon.prefix_sharing:
        return
    where = f"{name}.archon.prefix_sharing = true"
    unsupported = [
        (parallel_dims.cp_enabled, "with context parallel (it shards the row by position)"),
        (parallel_dims.pp_enabled, "with pipeline parallel (stages exchange fixed-shape rows)"),
        (config.archon.enable_compile, "with archon.enable_compile (each packing would be a new graph)"),
        (is_moe, "on a MoE model (its router statistics would count a shared prompt once)"),
    ]
    for refused, why in unsupported:
        if refused:
            raise EngineError(f"{where} does not run {why}; turn it off for backend '{config.backend}'")


def _prompt_lengths(loss_mask: torch.Tensor, indices: list[int], seqlens: list[int]) -> list[int]:
    """Tokens before the first loss token of each sequence (its whole length without one)."""
    rows = loss_mask[indices] > 0
    has_loss = rows.any(dim=1)
    first = rows.int().argmax(dim=1)
    return [int(f) if h else n for f, h, n in zip(first.tolist(), has_loss.tolist(), seqlens)]


def _shared_groups(batch: Batch, indices: list[int], seqlens: list[int]) -> list[tuple[list[int], int]]:
    """The sequences (positions in ``indices``) that share their prompt but its last token, with that length."""
    input_ids = batch["input_ids"].cpu()
    prompt_lens = _prompt_lengths(batch["loss_mask"].cpu(), indices, seqlens)
    groups: dict[bytes, list[int]] = {}
    for j, (row, p) in enumerate(zip(indices, prompt_lens)):
        if p - 1 >= MIN_SHARED_TOKENS:
            groups.setdefault(input_ids[row, : p - 1].numpy().tobytes(), []).append(j)
    return [(members, prompt_lens[members[0]] - 1) for members in groups.values() if len(members) > 1]


def prompt_groups(batch: Batch) -> list[tuple[list[int], int]]:
    """The batch's samples that share a prompt, with the tokens they share, for ``plan_microbatches`` to keep in
    one microbatch (a group split over microbatches or ranks holds its prompt once in each)."""
    if "loss_mask" not in batch:
        return []
    return _shared_groups(batch, list(range(batch["input_ids"].shape[0])), seqlens_of(batch))


def share_prefixes(batch: Batch, mb: PackedMicrobatch, multiple_of: int = 1) -> SharedPacking | None:
    """``mb`` packed with every prompt that several of its sequences share held once; None when none is shared.

    A group shares its prompt but the last token (``MIN_SHARED_TOKENS`` at least); the row is padded at the end
    to a multiple of ``multiple_of``, as the plain packing is.
    """
    if "loss_mask" not in batch or len(mb.indices) < 2:
        return None
    groups = _shared_groups(batch, mb.indices, mb.seqlens)
    if not groups:
        return None
    shared = {j: (members, a) for members, a in groups for j in members}
    input_ids = batch["input_ids"].cpu()

    starts = mb.cu_seqlens.tolist()
    # Host-side index building in Python ints, one tensor each at the end: a small tensor op per segment would cost
    # more than the attention it saves on a short completion.
    pieces: list[torch.Tensor] = []
    positions: list[int] = []
    segments: list[Segment] = []
    expand = [0] * mb.total_len
    length = 0

    def add(tokens: torch.Tensor, first_position: int, context: tuple[int, int] = (0, 0)) -> int:
        nonlocal length
        start, n = length, tokens.numel()
        pieces.append(tokens)
        positions.extend(range(first_position, first_position + n))
        segments.append(Segment(start, n, *context))
        length += n
        return start

    def tokens(k: int) -> torch.Tensor:
        return input_ids[mb.indices[k], : mb.seqlens[k]]

    done: set[int] = set()
    for j in range(len(mb.indices)):
        if j in done:
            continue
        if j not in shared:
            start = add(tokens(j), 0)
            expand[starts[j] : starts[j] + mb.seqlens[j]] = range(start, start + mb.seqlens[j])
            done.add(j)
            continue
        members, a = shared[j]
        prefix = add(tokens(j)[:a], 0)
        for k in members:
            rest = add(tokens(k)[a:], a, (prefix, a))
            expand[starts[k] : starts[k] + a] = range(prefix, prefix + a)
            expand[starts[k] + a : starts[k] + mb.seqlens[k]] = range(rest, rest + mb.seqlens[k] - a)
            done.add(k)
    n_real = length
    target = math.ceil(max(n_real, 1) / multiple_of) * multiple_of
    if target > n_real:
        add(torch.zeros(target - n_real, dtype=input_ids.dtype), 0)
    # The plain packing's padding reads any position: its outputs are never used.
    return SharedPacking(
        tokens=torch.cat(pieces).unsqueeze(0),
        positions=torch.tensor(positions).unsqueeze(0),
        segments=segment_layout(segments, target),
        expand=torch.tensor(expand),
        n_real_tokens=n_real,
    )
