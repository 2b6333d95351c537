"""Moving an engine's training state off its GPU and back (``actor.offload``: colocated servers generate meanwhile).

Parameters (with their gradients) move through ``Module.to``, which FSDP2 supports on sharded modules (it re-points
its shards); the optimizer's state follows tensor by tensor, so the optimizer keeps stepping the same Parameters.
What moves back is bit for bit what moved out.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def move_training_state(model: nn.Module | None, optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
    """Put ``model``'s parameters, gradients and buffers and ``optimizer``'s state on ``device``."""
    if model is not None:
        model.to(device)
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != device:
                    state[key] = value.to(device)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the freed blocks back, for the servers to take
