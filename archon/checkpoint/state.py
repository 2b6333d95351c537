"""The parts of an engine a checkpoint holds, each a ``Stateful`` (``state_dict`` / ``load_state_dict``).

An engine hands ``archon.checkpoint.dcp`` a dict of these (``model``, ``optimizer``,
``lr_scheduler``, ``train_state``), as torchtitan's ``CheckpointManager`` gets its states;
the checkpoint code never looks at the engine itself.  The model's state includes its
persistent buffers, so the MoE routing bias (``expert_bias``, which aux-free load balancing
moves every step) is saved and restored with the weights.
"""

from __future__ import annotations

import random
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
TRAIN_STATE = "train_state"


class ModelState:
    """The model's parameters and persistent buffers, by plain name (DTensors stay sharded)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=True))


class OptimizerState:
    """The optimizer's per-parameter tensors (``state``) and its ``param_groups``.

    Loading accepts param groups without their ``params`` (the hyper-parameters, the same on
    every rank): each is put on this rank's own parameter names, which differ between
    pipeline stages.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = cast("list[dict[str, Any]]", get_optimizer_state_dict(self.model, self.optimizer)["param_groups"])
        saved = state_dict["param_groups"]
        if len(mine) != len(saved):
            raise ValueError(
                f"it has {len(saved)} optimizer param group(s) but the engine has {len(mine)}; resume "
                "with the optimizer settings it was written with"
            )
        groups = [
            {**g, **{k: _from_json(v, g.get(k)) for k, v in s.items() if k != "params"}} for g, s in zip(mine, saved)
        ]
        set_optimizer_state_dict(self.model, self.optimizer, {"state": state_dict["state"], "param_groups": groups})


class LRSchedulerState:
    """The learning-rate scheduler's position (plain data)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


class TrainState:
    """The optimizer step count and the random generators (Python's, torch's CPU one and CUDA's)."""

    def __init__(self, device_type: str = "cpu", step: int = 0) -> None:
        self.device_type = device_type
        """'cuda' also saves and restores the CUDA generator."""
        self.step = step
        """Optimizer steps taken."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "step": self.step,
            "python_rng": [version, list(internal), gauss],
            "torch_rng": torch.get_rng_state(),
        }
        if self.device_type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        version, internal, gauss = state_dict["python_rng"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(state_dict["torch_rng"])
        if self.device_type == "cuda" and state_dict.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state_dict["cuda_rng"])


def _from_json(value: Any, current: Any) -> Any:
    """A param group value read back from JSON, in the type the optimizer holds it in."""
    if isinstance(value, list):
        return tuple(value)  # JSON turns tuples (AdamW's betas) into lists
    if isinstance(current, torch.Tensor):
        return torch.full_like(current, value)  # torchao's low-bit AdamW keeps lr as a tensor
    return value


def engine_states(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any, train_state: TrainState
) -> dict[str, Stateful]:
    """An engine's checkpointed parts: the model, the optimizer and LR scheduler when it has them, the train state."""
    states: dict[str, Stateful] = {MODEL: ModelState(model), TRAIN_STATE: train_state}
    if optimizer is not None:
        states[OPTIMIZER] = OptimizerState(model, optimizer)
    if lr_scheduler is not None:
        states[LR_SCHEDULER] = LRSchedulerState(lr_scheduler)
    return states
