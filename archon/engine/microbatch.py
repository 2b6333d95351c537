"""Cutting a global batch into data-parallel shares and packed microbatches.

Every rank holds the same global batch (a dict of right-padded ``[B, S]`` tensors with an
``attention_mask``), so every rank can compute every rank's split without communication.
That makes the plan identical everywhere, in particular the number of microbatches, which
all data-parallel ranks must agree on because FSDP's collectives run once per microbatch.

A microbatch is one packed row: its sequences are concatenated without padding and
``cu_seqlens`` marks the boundaries.  Padding appears only as one extra segment at the end,
to reach a length multiple that tensor/context parallel need, or a fixed length under
compile (``pad_to_maximum``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from archon.config import ConfigError
from models.common.shared_prefix import SegmentLayout

Batch = dict[str, torch.Tensor]
T = TypeVar("T")

ROUTED_EXPERTS = "routed_experts"
"""Batch key of the experts the rollout servers chose, ``[B, S, n_layers, top_k]`` (-1: none), for routing replay."""


def seqlens_of(batch: Batch) -> list[int]:
    """Real (unpadded) length of every sequence of a padded batch."""
    return batch["attention_mask"].sum(dim=1).tolist()


def balanced_partition(sizes: list[int], indices: list[int], n_parts: int) -> list[list[int]]:
    """Greedy longest-first assignment of ``indices`` (weights ``sizes[i]``) to ``n_parts`` bins.

    Deterministic: ties are broken by index, and each bin's indices come back sorted so
    samples keep their original order inside a bin.
    """
    heap = [(0, part) for part in range(n_parts)]
    bins: list[list[int]] = [[] for _ in range(n_parts)]
    for idx in sorted(indices, key=lambda i: (-sizes[i], i)):
        load, part = heapq.heappop(heap)
        bins[part].append(idx)
        heapq.heappush(heap, (load + sizes[idx], part))
    return [sorted(b) for b in bins]


def _count_microbatches(sizes: list[int], units: list[int], n_mbs: int, max_tokens: int) -> int:
    if max_tokens <= 0 or not units:
        return n_mbs
    total = sum(sizes[u] for u in units)
    k = max(n_mbs, math.ceil(total / max_tokens))
    while True:
        parts = balanced_partition(sizes, units, k)
        if all(sum(sizes[u] for u in p) <= max_tokens for p in parts):
            return k
        k += 1


@dataclass
class MicrobatchPlan:
    """Which samples each data-parallel rank trains on, cut into microbatches."""

    per_rank: list[list[list[int]]]
    """per_rank[dp_rank][mb] -> sorted sample indices (may be empty: the rank then runs a padding-only microbatch)."""

    @property
    def n_microbatches(self) -> int:
        return len(self.per_rank[0])


def plan_microbatches(
    seqlens: list[int],
    dp_size: int,
    n_mbs: int = 1,
    max_tokens_per_mb: int = 0,
    groups: list[tuple[list[int], int]] | None = None,
) -> MicrobatchPlan:
    """Split samples over dp ranks, then into the same number of microbatches on every rank.

    ``groups``: samples that share their first ``shared`` tokens, ``(indices, shared)``, kept in one microbatch
    and counted with those tokens once (prefix sharing), unless together they exceed ``max_tokens_per_mb``.
    """
    too_long = [i for i, n in enumerate(seqlens) if max_tokens_per_mb > 0 and n > max_tokens_per_mb]
    if too_long:
        i = too_long[0]
        raise ConfigError(
            f"sample {i} has {seqlens[i]} tokens, more than mb_spec.max_tokens_per_mb="
            f"{max_tokens_per_mb}; raise max_tokens_per_mb or shorten the data"
        )
    units: list[list[int]] = []
    sizes: list[int] = []
    grouped: set[int] = set()
    for members, shared in groups or []:
        size = shared + sum(seqlens[i] - shared for i in members)
        if max_tokens_per_mb <= 0 or size <= max_tokens_per_mb:
            units.append(sorted(members))
            sizes.append(size)
            grouped.update(members)
    for i, n in enumerate(seqlens):
        if i not in grouped:
            units.append([i])
            sizes.append(n)
    order = sorted(range(len(units)), key=lambda u: units[u][0])  # units in sample order: ties break alike
    units, sizes = [units[u] for u in order], [sizes[u] for u in order]
    shares = balanced_partition(sizes, list(range(len(units))), dp_size)
    k = max(_count_microbatches(sizes, share, n_mbs, max_tokens_per_mb) for share in shares)
    per_rank = [
        [sorted(i for u in part for i in units[u]) for part in balanced_partition(sizes, share, k)] for share in shares
    ]
    return MicrobatchPlan(per_rank)


@dataclass
class SharedPacking:
    """A microbatch's row with each shared prefix held once (``models/common/shared_prefix.py``)."""

    tokens: torch.Tensor
    """[1, M] token ids: prefixes, the remainders after them, unshared sequences, padding at the end."""
    positions: torch.Tensor
    """[1, M] positions: a remainder's continue its prefix's."""
    segments: SegmentLayout
    """The row's attention, segment by segment."""
    expand: torch.Tensor
    """int64 [T]: for every position of the plain packing, the position holding the same token here."""
    n_real_tokens: int
    """Tokens that are not padding (the first ones)."""


@dataclass
class PackedMicrobatch:
    """One packed row of sequences, ready for ``model(tokens, positions, cu_seqlens)``."""

    indices: list[int]
    """Sample indices (into the global batch) of the real sequences, in packing order."""
    seqlens: list[int]
    """Length of each real sequence."""
    tokens: torch.Tensor
    """[1, T] token ids, padding segment (if any) at the end."""
    positions: torch.Tensor
    """[1, T] positions, restarting at 0 for every sequence (and the padding segment)."""
    cu_seqlens: torch.Tensor
    """int32 [n_segments + 1] boundaries, including the padding segment."""
    n_real_tokens: int
    """Tokens that belong to real sequences (the rest is padding)."""
    routed_experts: torch.Tensor | None = None
    """``[1, T, n_layers, top_k]`` expert choices to replay (-1: route freely), or None."""
    shared: SharedPacking | None = None
    """The same sequences packed with their shared prompts once (``archon/engine/prefix_sharing.py``), or None."""

    @property
    def total_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def seq_starts(self) -> torch.Tensor:
        """Packed position of the first token of every segment."""
        return self.cu_seqlens[:-1].long()


def pack(
    batch: Batch, indices: list[int], multiple_of: int = 1, pad_to: int = 0, pad_token_id: int = 0
) -> PackedMicrobatch:
    """Concatenate the real tokens of ``indices``; pad once at the end to a multiple or a fixed length.

    An empty ``indices`` gives a padding-only microbatch so that a rank with no samples still
    joins the collectives of its data-parallel group.
    """
    input_ids = batch["input_ids"]
    seqlens = batch["attention_mask"].sum(dim=1)[list(indices)].tolist()
    pieces = [concat_rows(input_ids, indices, seqlens)]
    n_real = sum(seqlens)
    target = max(n_real, 1)
    if pad_to:
        if n_real > pad_to:
            raise ValueError(
                f"a microbatch has {n_real} tokens but pad_to_maximum pads to {pad_to}; raise mb_spec.max_tokens_per_mb"
            )
        target = pad_to
    target = math.ceil(target / multiple_of) * multiple_of
    n_pad = target - n_real
    seg_lens = seqlens + ([n_pad] if n_pad else [])
    device = input_ids.device
    if n_pad:
        pieces.append(torch.full((n_pad,), pad_token_id, dtype=input_ids.dtype, device=device))
    tokens = torch.cat(pieces).unsqueeze(0)
    seg_len_t = torch.tensor(seg_lens, device=device)
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(seg_len_t, 0)
    # Each token's position within its sequence: its index minus where its sequence starts.
    starts = cu[:-1].long().repeat_interleave(seg_len_t)
    positions = (torch.arange(target, device=device) - starts).unsqueeze(0)
    return PackedMicrobatch(list(indices), seqlens, tokens, positions, cu, n_real)


def pack_token_values(values: torch.Tensor, mb: PackedMicrobatch, fill: float = 0.0) -> torch.Tensor:
    """Per-token rows ``values [B, S, ...]`` packed like ``mb``'s tokens: ``[1, T, ...]``, padding ``fill``."""
    out = values.new_full((mb.total_len, *values.shape[2:]), fill)
    out[: mb.n_real_tokens] = concat_rows(values, mb.indices, mb.seqlens)
    return out.unsqueeze(0)


def concat_rows(values: torch.Tensor, indices: list[int], seqlens: list[int]) -> torch.Tensor:
    """``values[i, :n]`` for each ``i, n`` of ``indices, seqlens``, concatenated: ``[sum(seqlens), ...]``.

    A few tensor ops whatever the number of rows (an RL batch has hundreds of short ones).
    """
    if not indices:
        return values.new_empty((0, *values.shape[2:]))
    width = max(seqlens)
    rows = values.index_select(0, torch.tensor(indices, device=values.device))[:, :width]
    lens = torch.tensor(seqlens, device=values.device)
    return rows[torch.arange(width, device=values.device) < lens[:, None]]


def rows_of(batch: Batch, indices: list[int]) -> Batch:
    """The batch restricted to ``indices`` and trimmed to their longest sequence."""
    if not indices:
        return {k: v[:0] for k, v in batch.items()}
    idx = torch.tensor(indices, device=batch["input_ids"].device)
    width = int(batch["attention_mask"][idx].sum(dim=1).max())
    out = {}
    for key, value in batch.items():
        rows = value.index_select(0, idx.to(value.device))
        out[key] = rows[:, :width] if rows.dim() >= 2 and value.shape[1] == batch["input_ids"].shape[1] else rows
    return out


def unpack(
    packed_values: torch.Tensor, mb: PackedMicrobatch, width: int | None = None, fill: float = 0.0
) -> torch.Tensor:
    """Per-token packed values ``[T]`` back to right-padded rows ``[len(indices), width]``."""
    width = width if width is not None else max(mb.seqlens, default=0)
    out = packed_values.new_full((len(mb.seqlens), width), fill)
    if not mb.seqlens:
        return out
    starts = mb.cu_seqlens[: len(mb.seqlens)].long()
    lens = torch.tensor(mb.seqlens, device=packed_values.device)
    col = torch.arange(width, device=packed_values.device)
    valid = col.unsqueeze(0) < lens.unsqueeze(1)
    src = (starts.unsqueeze(1) + col.unsqueeze(0))[valid]
    return out.masked_scatter(valid, packed_values[src])


def pad_rows_to(values: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """Right-pad ``[b, s]`` to ``[b, width]``."""
    if values.shape[1] >= width:
        return values[:, :width]
    pad = values.new_full((values.shape[0], width - values.shape[1]), fill)
    return torch.cat([values, pad], dim=1)


def to_device(value: T, device: torch.device) -> T:
    """A tensor, a dict of tensors or a dataclass of them (a packed microbatch) with its tensors on ``device``.

    Host tensors go through pinned memory without blocking, so the copy waits for nothing on the
    GPU: a plain host-to-GPU copy synchronises the stream, one host sync per tensor.
    """
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        if device.type == "cuda" and value.device.type == "cpu":
            return value.pin_memory().to(device, non_blocking=True)  # type: ignore[return-value]
        return value.to(device)  # type: ignore[return-value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}  # type: ignore[return-value]
    if isinstance(value, list):
        return [to_device(v, device) for v in value]  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved: dict[str, Any] = {
            f.name: to_device(getattr(value, f.name), device)
            for f in dataclasses.fields(value)
            if isinstance(getattr(value, f.name), (torch.Tensor, list))
            or dataclasses.is_dataclass(getattr(value, f.name))
        }
        return dataclasses.replace(value, **moved)
    return value


def on_host(batch: Batch) -> Batch:
    """``batch`` on the CPU, where planning, packing and loss weights read it without waiting for a GPU."""
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
