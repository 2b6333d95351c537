"""How one training step's loss adds up: each microbatch's share of the global-batch loss.

A microbatch's loss is weighted by its share of the batch's loss weight (by default its real
tokens), so the step's loss and gradients are those of the whole global batch, whatever the
allocation and the microbatching.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from archon.engine.microbatch import Batch

LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(per-token outputs, microbatch rows) -> (loss, stats)``: the mean over the microbatch's weight."""
LossWeightFn = Callable[[Batch], float]
"""The loss weight of a set of rows (the global batch, or one microbatch)."""


def token_count_weight(mb: Batch) -> float:
    """Loss tokens (``loss_mask``), or real tokens without one."""
    return float(mb["loss_mask"].sum()) if "loss_mask" in mb else float(mb["attention_mask"].sum())


Value = float | torch.Tensor
"""A float, or a 0-dim tensor still on the device until the step's one read (``StepTotals.read``)."""


@dataclass
class StepTotals:
    """What one rank's microbatches of a step add up to, before reduction over ranks.

    Losses and stats stay tensors on the device while the microbatches run: reading each one
    (``float``, ``.item()``) would wait for the GPU once per value and microbatch.  ``read``
    brings them all back in one transfer.
    """

    loss: Value = 0.0
    """Sum of the microbatches' weighted losses."""
    stats: dict[str, Value] = field(default_factory=dict)
    """Weighted sums of the loss function's stats; extremes (``extreme_stat``) by max or min instead."""
    tokens: int = 0
    """Real (unpadded) tokens."""

    def add(self, scaled_loss: torch.Tensor, stats: Mapping[str, Value], share: float) -> None:
        """One microbatch: its scaled loss and its stats, which weigh ``share`` of the global batch."""
        # float64, as Python floats summed them when every value was read at once.
        self.loss = self.loss + scaled_loss.detach().to(torch.float64)
        for key, value in stats.items():
            value = value.detach().to(torch.float64) if isinstance(value, torch.Tensor) else float(value)
            prev = self.stats.get(key)
            kind = extreme_stat(key)
            if kind is None:
                self.stats[key] = (0.0 if prev is None else prev) + value * share
            elif prev is None:
                self.stats[key] = value
            elif isinstance(prev, torch.Tensor) or isinstance(value, torch.Tensor):
                pair = (torch.as_tensor(prev), torch.as_tensor(value))
                self.stats[key] = torch.maximum(*pair) if kind == "max" else torch.minimum(*pair)
            else:
                self.stats[key] = max(prev, value) if kind == "max" else min(prev, value)

    def read(self, *extra: torch.Tensor) -> list[float]:
        """Turn the loss and stats into floats, and return ``extra`` (e.g. the gradient norm) as floats: one read."""
        keys = sorted(self.stats)
        values = read_floats([*extra, self.loss, *(self.stats[k] for k in keys)])
        self.loss = values[len(extra)]
        self.stats = dict(zip(keys, values[len(extra) + 1 :]))
        return values[: len(extra)]


def read_floats(values: list[Value]) -> list[float]:
    """``values`` as floats; the tensors among them come back in one device-to-host copy per device (one
    host sync on a GPU; host tensors, such as a gradient norm under CPU offload, cost none)."""
    plain = [(t.full_tensor() if isinstance(t, DTensor) else t) if isinstance(t, torch.Tensor) else t for t in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(plain):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    out = [float(v) if not isinstance(v, torch.Tensor) else 0.0 for v in plain]
    for where in by_device.values():
        stacked = torch.stack([cast(torch.Tensor, plain[i]).reshape(()).to(torch.float64) for i in where])
        for i, value in zip(where, stacked.tolist()):
            out[i] = value
    return out


def microbatch_loss(
    outputs: dict[str, torch.Tensor],
    rows: Batch | None,
    weight: float,
    loss_fn: LossFn,
    total_weight: float,
    totals: StepTotals,
) -> torch.Tensor:
    """This microbatch's share of the global loss (``weight`` / ``total_weight``); stats are added to ``totals``.

    ``rows`` are the microbatch's rows of the batch on the device, ``weight`` their loss weight
    (``LossWeightFn``, computed on the host copy).  ``outputs`` carries ``_anchor``, a zero with
    a graph through the model: a rank without samples (``rows`` None) still runs backward with
    it, so that FSDP's collectives line up.
    """
    anchor = outputs.pop("_anchor")
    if rows is None:
        loss, stats, weight = anchor, {}, 0.0
    else:
        loss, stats = loss_fn(outputs, rows)
    scaled = loss * (weight / total_weight)
    totals.add(scaled, stats, weight / total_weight)
    return scaled


def extreme_stat(key: str) -> str | None:
    """'max' or 'min' for a stat reduced by its extreme over microbatches and ranks (a key ending
    in ``/max`` or ``/min``), None for one that is averaged by loss weight."""
    tail = key.rsplit("/", 1)[-1]
    return tail if tail in ("max", "min") else None


def reduce_step_totals(totals: StepTotals, dp_group: dist.ProcessGroup | None) -> tuple[list[str], torch.Tensor]:
    """Stat names and ``[loss, tokens, *stats]`` summed over the data-parallel ranks (``dp_group``;
    None: one rank), float64; extremes (``extreme_stat``) reduced by max or min, after the sums.
    ``totals`` must have been ``read`` (its values are floats)."""
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
