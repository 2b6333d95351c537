"""How one training step's loss adds up: each microbatch's share of the global-batch loss.

A microbatch's loss is weighted by its share of the batch's loss weight (by default its real
tokens), so the step's loss and gradients are those of the whole global batch, whatever the
allocation and the microbatching.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

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
    """Weighted sums of the loss function's stats."""
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
        totals.stats[key] = totals.stats.get(key, 0.0) + value * weight / total_weight
    return scaled
