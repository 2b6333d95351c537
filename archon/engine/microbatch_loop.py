"""A step's microbatches, one after another, the same for every engine: plan, pack, run, loss, backward.

Every rank plans the same microbatches from the host batch (``plan_rank_microbatches``) and
runs its data-parallel share of them.  What differs between engines (how a microbatch is
packed, which positions the loss reads, how the model runs on it) is a ``MicrobatchRunner``
each engine provides; what does not (the microbatch's rows and loss weight, gradient sync on
the last microbatch only, the loss share and its backward, collecting per-token rows) is here.
Pipeline parallel runs its microbatches through a schedule instead (``ArchonEngine``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from torch.distributed.fsdp import FSDPModule

from archon.config import ConfigError, MicroBatchSpec, TrainEngineConfig
from archon.engine.errors import EngineError
from archon.engine.microbatch import ROUTED_EXPERTS, Batch, plan_microbatches, rows_of, seqlens_of, to_device
from archon.engine.step_loss import LossFn, LossWeightFn, StepTotals, microbatch_loss
from archon.engine.token_outputs import CollectedRows


class EngineMicrobatch(Protocol):
    """A packed (or padded) microbatch as an engine's runner makes it."""

    n_real_tokens: int
    """Tokens that belong to real sequences."""


MB = TypeVar("MB", bound=EngineMicrobatch)


class MicrobatchRunner(Protocol[MB]):
    """The engine-specific half of the microbatch loop: packing and running the model."""

    def pack(self, batch: Batch, indices: list[int]) -> MB:
        """Samples ``indices`` of the host ``batch`` as one microbatch (on the host)."""
        ...

    def loss_positions(self, batch: Batch, mb: MB) -> torch.Tensor | None:
        """The positions of ``mb`` whose outputs the loss reads; None for every position."""
        ...

    def run(self, mb: MB, keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The model on ``mb`` (on the device): token-aligned per-token rows and ``_anchor`` (``token_outputs``)."""
        ...


def pads_to_maximum(config: TrainEngineConfig) -> bool:
    """Whether packed rows are padded to ``mb_spec.max_tokens_per_mb`` (one shape for compile), which needs a limit."""
    if (config.pad_to_maximum or config.archon.enable_compile) and config.mb_spec.max_tokens_per_mb <= 0:
        return False
    return config.pad_to_maximum or config.archon.enable_compile


def plan_rank_microbatches(
    batch: Batch,
    mb_spec: MicroBatchSpec,
    dp_size: int,
    dp_rank: int,
    name: str,
    runnable: Callable[[int], int] | None = None,
    groups: list[tuple[list[int], int]] | None = None,
) -> list[list[int]]:
    """This data-parallel rank's microbatches (sample indices) of the host ``batch``.

    ``runnable`` maps a microbatch count to the next one the engine can run (a pipeline
    schedule's rule); when ``max_tokens_per_mb`` asks for a count it cannot run, the plan is
    made again with that one.  ``groups``: samples kept in one microbatch (``plan_microbatches``).
    """
    lens = seqlens_of(batch)
    n_mbs = mb_spec.n_mbs if runnable is None else runnable(mb_spec.n_mbs)
    try:
        plan = plan_microbatches(lens, dp_size, n_mbs, mb_spec.max_tokens_per_mb, groups)
        count = plan.n_microbatches if runnable is None else runnable(plan.n_microbatches)
        if count != plan.n_microbatches:
            plan = plan_microbatches(lens, dp_size, count, mb_spec.max_tokens_per_mb, groups)
    except ConfigError as exc:  # a sample longer than mb_spec.max_tokens_per_mb
        raise EngineError(f"{name}: {exc}") from None
    return plan.per_rank[dp_rank]


def microbatch_rows(
    batch: Batch, indices: list[int], loss_weight_fn: LossWeightFn, device: torch.device
) -> tuple[Batch | None, float]:
    """A microbatch's rows of the host ``batch`` on the device (None without samples), and their loss weight."""
    if not indices:
        return None, 0.0
    rows = rows_of(batch, indices)
    rows.pop(ROUTED_EXPERTS, None)  # replayed routing reaches the model packed, never the loss
    return to_device(rows, device), float(loss_weight_fn(rows))


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Whether FSDP reduces gradients after this backward (only the last microbatch's need it)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def train_microbatches(
    runner: MicrobatchRunner[MB],
    model: torch.nn.Module,
    batch: Batch,
    my_mbs: list[list[int]],
    *,
    loss_fn: LossFn,
    loss_weight_fn: LossWeightFn,
    total_weight: float,
    grad_scale: float,
    totals: StepTotals,
    device: torch.device,
) -> None:
    """Forward and backward of this rank's microbatches ``my_mbs``; losses, stats and tokens add up in ``totals``.

    Each microbatch's loss is its share of the global batch's weight (``total_weight``) times
    ``grad_scale`` (undoing FSDP's gradient division, so gradients are those of the global loss).
    """
    for i, indices in enumerate(my_mbs):
        set_gradient_sync(model, i == len(my_mbs) - 1)
        packed = runner.pack(batch, indices)
        keep = to_device(runner.loss_positions(batch, packed), device)
        outputs = runner.run(to_device(packed, device), keep=keep)
        rows, weight = microbatch_rows(batch, indices, loss_weight_fn, device)
        scaled = microbatch_loss(outputs, rows, weight, loss_fn, total_weight, totals)
        (scaled * grad_scale).backward()
        totals.tokens += packed.n_real_tokens


def forward_microbatches(
    runner: MicrobatchRunner[MB], batch: Batch, my_mbs: list[list[int]], rows: CollectedRows, device: torch.device
) -> None:
    """This rank's microbatches ``my_mbs`` through the model; their per-token rows go into ``rows``."""
    for indices in my_mbs:
        rows.add(runner.run(to_device(runner.pack(batch, indices), device)), indices)
