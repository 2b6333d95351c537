"""Parallelization of Qwen2: the shared Qwen decoder plan (TP -> EP -> CP -> AC -> compile -> FSDP)."""

from __future__ import annotations

import torch.nn as nn

from models.common.infra.parallelize import parallelize_decoder
from parallel.dims import ParallelDims
from parallel.options import ParallelizeOptions


def parallelize_qwen2(model: nn.Module, *, parallel_dims: ParallelDims, options: ParallelizeOptions) -> nn.Module:
    """Lay a meta-device Qwen2 model over the meshes of ``parallel_dims`` (see ``parallelize_decoder``)."""
    return parallelize_decoder(model, parallel_dims=parallel_dims, options=options)
