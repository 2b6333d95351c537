"""How one training step's loss adds up: each microbatch's share of the global-batch loss.

A microbatch's loss is weighted by its share of the batch's loss weight (by default its real
tokens), so the step's loss and gradients are those of the whole global batch, whatever the
allocation and the microbatching.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from archon.engine.microbatch import Batch, rows_of

LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(per-token outputs, microbatch rows) -> (loss, stats)``: the mean over the microbatch's weight."""
LossWeightFn = Callable[[Batch], float]
"""The loss weight of a set of rows (the global batch, or one microbatch)."""


def token_count_weight(mb: Batch) -> float:
    """Loss tokens (``loss_mask``), or real tokens without one."""
    return float(mb["loss_mask"].sum()) if "loss_mask" in mb else float(mb["attention_mask"].sum())


@dataclass
class StepTotals:
    """What one rank's microbatches of a step add up to, before reduction over ranks."""

    loss: float = 0.0
    """Sum of the microbatches' weighted losses."""
    stats: dict[str, float] = field(default_factory=dict)
    """Weighted sums of the loss function's stats; extremes (``extreme_stat``) by max or min instead."""
    tokens: int = 0
    """Real (unpadded) tokens."""


def microbatch_loss(
    outputs: dict[str, torch.Tensor],
    batch: Batch,
    indices: list[int],
    loss_fn: LossFn,
    loss_weight_fn: LossWeightFn,
    total_weight: float,
    totals: StepTotals,
) -> torch.Tensor:
    """This microbatch's share of the global loss (its weight / the batch's); stats are added to ``totals``.

    ``outputs`` carries ``_anchor``, a zero with a graph through the model: a rank without
    samples still runs backward with it, so that FSDP's collectives line up.
    """
    anchor = outputs.pop("_anchor")
    if indices:
        mb = rows_of(batch, indices)
        loss, stats = loss_fn(outputs, mb)
        weight = float(loss_weight_fn(mb))
    else:
        loss = anchor
        stats, weight = {}, 0.0
    scaled = loss * (weight / total_weight)
    totals.loss += float(scaled.detach())
    for key, value in stats.items():
        value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        if extreme_stat(key) == "max":
            totals.stats[key] = max(totals.stats.get(key, value), value)
        elif extreme_stat(key) == "min":
            totals.stats[key] = min(totals.stats.get(key, value), value)
        else:
            totals.stats[key] = totals.stats.get(key, 0.0) + value * weight / total_weight
    return scaled


def extreme_stat(key: str) -> str | None:
    """'max' or 'min' for a stat reduced by its extreme over microbatches and ranks (a key ending
    in ``/max`` or ``/min``), None for one that is averaged by loss weight."""
    tail = key.rsplit("/", 1)[-1]
    return tail if tail in ("max", "min") else None


def reduce_step_totals(totals: StepTotals, dp_group: dist.ProcessGroup | None) -> tuple[list[str], torch.Tensor]:
    """Stat names and ``[loss, tokens, *stats]`` summed over the data-parallel ranks (``dp_group``;
    None: one rank), float64; extremes (``extreme_stat``) reduced by max or min, after the sums."""
    keys = sorted(k for k in totals.stats if extreme_stat(k) is None)
    reduced = torch.tensor([totals.loss, float(totals.tokens)] + [totals.stats[k] for k in keys], dtype=torch.float64)
    extremes = sorted(k for k in totals.stats if extreme_stat(k) is not None)
    # One max-reduction for both kinds: a minimum is the max of its negation.
    signs = torch.tensor([1.0 if extreme_stat(k) == "max" else -1.0 for k in extremes], dtype=torch.float64)
    signed = torch.tensor([totals.stats[k] for k in extremes], dtype=torch.float64) * signs
    if dp_group is not None:
        dist.all_reduce(reduced, group=dp_group)
        if extremes:
            dist.all_reduce(signed, op=dist.ReduceOp.MAX, group=dp_group)
    return keys + extremes, torch.cat([reduced, signed * signs])
