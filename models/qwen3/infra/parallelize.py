"""Parallelization of Qwen3: the shared Qwen decoder plan (TP -> EP -> CP -> AC -> compile -> FSDP)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from models.common.parallelize import parallelize_decoder


def parallelize_qwen3(model: nn.Module, parallel_dims: Any, config: Any) -> nn.Module:
    """Lay a meta-device Qwen3 model over the meshes of ``parallel_dims`` (see ``parallelize_decoder``)."""
    return parallelize_decoder(model, parallel_dims, config)
