"""The optimizer side of a training step, the same for every engine: loss weight, gradient clip,
the non-finite check, the optimizer and LR-scheduler steps, and the step's stats.

An engine holds one ``StepRunner`` when it is trainable.  ``begin`` readies a step (train mode,
the batch on the host, its loss weight); the engine then runs its microbatches' forward and
backward; ``finish`` clips the gradients, reads the step's numbers from the device once, steps
the optimizer unless the gradient norm is non-finite (then it warns and skips the update), and
advances the LR schedule and the step count.  ``StepOutcome.stats`` is what ``train_batch`` returns.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from archon.checkpoint.state import TrainState
from archon.config import TrainEngineConfig
from archon.engine.errors import EngineError
from archon.engine.microbatch import Batch, on_host
from archon.engine.optimizer import build_lr_scheduler, build_optimizer
from archon.engine.step_loss import LossWeightFn, StepTotals
from archon.runtime.drill import drill_point
from parallel.grad_clip import clip_grad_norm_

logger = logging.getLogger("archon.engine")


@dataclass
class StepOutcome:
    """What the optimizer step of one training step came to."""

    grad_norm: float
    """The gradient norm before clipping (non-finite when the step was skipped)."""
    stepped: bool
    """Whether the optimizer updated the weights."""
    lr: float
    """The learning rate the step used."""
    started: float
    """``time.perf_counter()`` when the step began."""

    def stats(self, keys: list[str], reduced: torch.Tensor) -> dict[str, float]:
        """``train_batch``'s result from the step's totals as ``reduce_step_totals`` returns them
        (``keys`` and ``[loss, tokens, *stats]``)."""
        result = {
            "loss": float(reduced[0]),
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "tokens": float(reduced[1]),
            "update_skipped": float(not self.stepped),
            "train_time_s": time.perf_counter() - self.started,
        }
        result.update({k: float(v) for k, v in zip(keys, reduced[2:].tolist())})
        return result


class StepRunner:
    """An engine's optimizer, LR scheduler and step count, and the parts of a step around its microbatches."""

    def __init__(
        self,
        name: str,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: LRScheduler,
        train_state: TrainState,
        max_grad_norm: float,
    ) -> None:
        self.name = name
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_state = train_state
        self.max_grad_norm = max_grad_norm
        self.after_step: list[Callable[[], None]] = []
        """Called after each optimizer step that updated the weights (fp8's scale precompute)."""

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, config: TrainEngineConfig, name: str, train_state: TrainState, total_steps: int
    ) -> StepRunner:
        """AdamW over ``model``'s trainable parameters and the configured LR schedule over ``total_steps``."""
        optimizer = build_optimizer(model.parameters(), config.optimizer)
        scheduler = build_lr_scheduler(optimizer, config.optimizer, total_steps)
        return cls(name, optimizer, scheduler, train_state, config.optimizer.max_grad_norm)

    def begin(self, model: torch.nn.Module, batch: Batch, loss_weight_fn: LossWeightFn) -> tuple[Batch, float, float]:
        """Ready a step: ``model`` in train mode, ``batch`` on the host (planned, packed and weighed
        there; microbatches go to the device one by one); returns it, its loss weight and the start time."""
        started = time.perf_counter()
        model.train()
        batch = on_host(batch)
        total_weight = float(loss_weight_fn(batch))
        if total_weight <= 0:
            raise EngineError(
                f"{self.name}: the batch has no loss weight (e.g. every loss_mask is 0); nothing to train on"
            )
        return batch, total_weight, started

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish(
        self,
        parameters: Iterable[torch.nn.Parameter],
        totals: StepTotals,
        started: float,
        pp_group: dist.ProcessGroup | None = None,
    ) -> StepOutcome:
        """Clip, then step the optimizer unless the gradient norm is non-finite; advance the schedule and the step.

        The host waits for the device once: the gradient norm decides the step, and the step's
        losses and stats (``totals``) come back with it (``StepTotals.read``).
        """
        grad_norm = clip_grad_norm_(parameters, self.max_grad_norm, pp_group=pp_group)
        (norm,) = totals.read(grad_norm)
        finite = math.isfinite(norm)
        lr = float(self.optimizer.param_groups[0]["lr"])  # torchao's optimizers keep it as a tensor
        drill_point("optimizer_step")
        if finite:
            self.optimizer.step()
            for hook in self.after_step:
                hook()
        else:
            logger.warning(
                "%s: non-finite gradient norm at step %d; the optimizer step is skipped",
                self.name,
                self.train_state.step,
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.train_state.step += 1
        return StepOutcome(norm, finite, lr, started)
