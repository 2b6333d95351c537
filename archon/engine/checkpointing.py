"""An engine's checkpoint, the same for every engine: its Stateful parts, written and read with DCP.

``EngineCheckpoint`` names what one engine's checkpoint holds (``archon.checkpoint.state``:
model, optimizer and LR scheduler when trainable, train state) and hands it to
``archon.checkpoint.dcp``, which reshards across allocations; it also sizes one checkpoint for
the manager's disk-space check.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from archon.alloc import ModelAllocation
from archon.checkpoint.dcp import load_checkpoint, save_checkpoint
from archon.checkpoint.state import TrainState, engine_states


@dataclass
class EngineCheckpoint:
    """The checkpointed parts of engine ``name`` on ``allocation``."""

    name: str
    """The engine's name (``actor``, ``critic``); errors say it."""
    allocation: ModelAllocation
    """The allocation the engine runs; recorded with the checkpoint."""
    model: torch.nn.Module
    """The (sharded) model."""
    optimizer: torch.optim.Optimizer | None
    """The optimizer; None for a frozen engine."""
    lr_scheduler: Any
    """The LR scheduler; None for a frozen engine."""
    train_state: TrainState
    """Optimizer steps taken and the random generators."""

    def states(self) -> dict[str, Stateful]:
        """The model, the optimizer and LR scheduler (when trainable), and the train state."""
        return engine_states(self.model, self.optimizer, self.lr_scheduler, self.train_state)

    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        """Write a resumable checkpoint to ``path`` (collective); ``extra_state`` is the caller's JSON data."""
        save_checkpoint(self.states(), Path(path), extra_state or {}, name=self.name, allocation=str(self.allocation))

    def load(self, path: str | Path) -> dict[str, Any]:
        """Resume from a checkpoint written by ``save`` (any allocation; collective); returns its extra state."""
        return load_checkpoint(self.states(), Path(path), name=self.name)

    def nbytes(self) -> float:
        """This rank's share of one checkpoint's bytes: parameters, and AdamW's two moments with an optimizer.

        A parameter's global size counts once however it is sharded: each rank of a pipeline stage
        counts its stage's global sizes divided by the ranks that hold that stage.
        """
        ranks_per_stage = dist.get_world_size() / self.allocation.parallel.pp_size
        per_param = 3 if self.optimizer is not None else 1
        stage = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return per_param * stage / ranks_per_stage
