"""``TrainEngine``: what the rest of Archon asks of a training engine, whichever backend runs it.

``ArchonEngine`` (``archon:``, Archon's own models) and ``FSDPEngine`` (``fsdp:``, any
transformers causal LM) implement it side by side; ``build_engine`` picks one by the allocation
string.  Its callers: the RL actor, critic, reference and teacher (``train_batch``, ``forward``,
``seed``, ``step``), SFT and the trainer (``initialize``, ``export_hf``, ``device_type``), the
checkpoint manager (``save``, ``load``, ``checkpoint_nbytes``; ``archon.checkpoint.manager.Checkpointable``),
weight sync (``named_full_tensors``, ``export_hf``; ``archon.rollout.weight_sync.WeightSyncEngine``)
and gpu_check (``model``, ``optimizer``).

Every rank calls every method with the same global batch (a dict of right-padded ``[B, S]``
tensors with ``attention_mask``).  Per-token outputs are token-aligned:
``logprobs[b, i] = log p(input_ids[b, i] | input_ids[b, :i])`` (0 at each sequence's first
token); a critic's ``values[b, i]`` is the value of the state before token ``i``.

An engine is built with the constructor ``TrainEngine.__init__`` declares (``build_engine``
passes its keywords on) and does nothing until ``initialize()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch.distributed.checkpoint.stateful import Stateful

from archon.alloc import ModelAllocation
from archon.checkpoint.state import TrainState
from archon.config import TrainEngineConfig
from archon.engine.checkpointing import EngineCheckpoint
from archon.engine.errors import EngineError
from archon.engine.microbatch import Batch
from archon.engine.offload import move_training_state
from archon.engine.step_loss import LossFn, LossWeightFn, token_count_weight

E = TypeVar("E", bound="TrainEngine")


class TrainEngine(ABC):
    """Builds, trains, evaluates, checkpoints and exports one model (actor, critic, reference or teacher)."""

    backend: ClassVar[str]
    """The allocation backend the engine runs (``archon``, ``fsdp``)."""
    config: TrainEngineConfig
    """The engine's config section (``actor``, ``critic``, ``ref``, ...)."""
    name: str
    """The config section's name; errors and logs say it."""
    is_critic: bool
    """A value model: ``forward`` returns ``values`` instead of ``logprobs`` and ``entropy``."""
    seed: int
    """The run seed: initial weights and the actor's minibatch shuffles derive from it."""
    trainable: bool
    """False for a frozen model (reference, teacher): no optimizer, no gradients."""
    device_type: str
    """``cuda`` or ``cpu`` (set by ``initialize``)."""
    device: torch.device
    """This rank's compute device (set by ``initialize``)."""
    model: torch.nn.Module | None
    """The (sharded) model; None before ``initialize``."""
    optimizer: torch.optim.Optimizer | None
    """AdamW over the trainable parameters; None before ``initialize`` and for a frozen engine."""
    lr_scheduler: Any
    """The optimizer's LR schedule; None before ``initialize`` and for a frozen engine."""
    allocation: ModelAllocation
    """``config.backend`` parsed (set by ``initialize``)."""
    train_state: TrainState
    """Step count and random generators: the checkpoint's train state."""

    @abstractmethod
    def __init__(
        self,
        config: TrainEngineConfig,
        *,
        name: str = "actor",
        is_critic: bool = False,
        seed: int = 1,
        device: str = "auto",
        temperature: float = 1.0,
        total_steps: int = 1,
        trainable: bool = True,
        allocation: ModelAllocation | None = None,
    ) -> None:
        """Remember the settings; nothing is built until ``initialize``.

        ``device``: ``auto``, ``cuda`` or ``cpu``; ``temperature`` divides the logits of
        ``forward`` and ``train_batch`` (the rollout's sampling temperature); ``total_steps``
        sizes the LR schedule; ``allocation`` is ``config.backend`` already parsed (None: parse it).
        """

    @property
    @abstractmethod
    def step(self) -> int:
        """Optimizer steps taken (restored by ``load``)."""

    @abstractmethod
    def initialize(self: E) -> E:
        """Join the process group, build the device meshes, build and load the model; returns the engine."""

    @abstractmethod
    def train_batch(
        self, batch: Batch, loss_fn: LossFn, loss_weight_fn: LossWeightFn = token_count_weight
    ) -> dict[str, float]:
        """Forward+backward over every microbatch, then one optimizer step; returns the step's global stats.

        The loss is normalised by the global batch's weight (``loss_weight_fn``), so a step's loss
        and gradients do not depend on the allocation or on microbatching.  A non-finite gradient
        norm skips the optimizer step (``update_skipped`` is 1).
        """

    @abstractmethod
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` (or ``values`` for a critic), ``[B, S]``, global batch order."""

    @abstractmethod
    def named_full_tensors(
        self, dtype: torch.dtype | None = None, extras: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time, cast to ``dtype``; a collective: every rank must iterate.

        ``extras`` adds what the HF architecture has no field for (the MoE routing bias), for
        Archon's own server.
        """

    @abstractmethod
    def export_hf(
        self,
        path: str | Path,
        dtype: torch.dtype | None = None,
        max_shard_size: str | int = "5GB",
        extras: bool = False,
    ) -> None:
        """Write an HF folder (config.json + sharded safetensors) that ``from_pretrained`` loads; rank 0 writes."""

    def export_peft(self, path: str | Path) -> bool:
        """Write the LoRA adapters as a PEFT adapter folder (rank 0 writes); False where this engine cannot, in which
        case ``export_hf``'s merged weights are the only export."""
        return False

    def adapters_off(self) -> AbstractContextManager[None]:
        """A context in which ``forward`` computes the base model alone, LoRA adapters off (the RL reference of a
        LoRA actor, without a second copy of the weights); an engine without adapters refuses."""
        raise EngineError(
            f"{self.name}: this engine has no LoRA adapters to turn off; set {self.name}.lora.enabled = true "
            "or give the reference its own engine"
        )

    # Checkpoints are the same for every engine: its parts, composed into an EngineCheckpoint.
    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to the CPU (``actor.offload``, colocated servers)."""
        move_training_state(self.model, self.optimizer, torch.device("cpu"))

    def onload(self) -> None:
        """Bring back to ``device`` what ``offload`` moved to the CPU."""
        move_training_state(self.model, self.optimizer, self.device)

    def _checkpoint(self) -> EngineCheckpoint:
        assert self.model is not None, "initialize() first"
        return EngineCheckpoint(
            self.name, self.allocation, self.model, self.optimizer, self.lr_scheduler, self.train_state
        )

    def checkpoint_states(self) -> dict[str, Stateful]:
        """What a checkpoint of this engine holds: the model, the optimizer and LR scheduler (when trainable),
        and the train state (step, random generators)."""
        return self._checkpoint().states()

    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        """Write a resumable checkpoint to ``path`` (collective); ``extra_state`` is the caller's JSON data."""
        self._checkpoint().save(path, extra_state)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Resume from a checkpoint written by ``save`` (any allocation; collective); returns its extra state."""
        return self._checkpoint().load(path)

    def checkpoint_nbytes(self) -> float:
        """This rank's share of one checkpoint's bytes: parameters, and AdamW's two moments with an optimizer."""
        return self._checkpoint().nbytes()
