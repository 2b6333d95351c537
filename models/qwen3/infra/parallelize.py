"""Parallelization of Qwen3 (applied by the engine)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from models.infra import require_single_device


def parallelize_qwen3(model: nn.Module, parallel_dims: Any, config: Any) -> nn.Module:
    """Apply TP -> CP -> activation checkpointing -> compile -> FSDP2; single device for now."""
    require_single_device(parallel_dims, "qwen3")
    return model
