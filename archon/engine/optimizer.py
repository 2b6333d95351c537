"""AdamW and the warmup + constant/cosine/linear learning-rate schedule."""

from __future__ import annotations

import importlib
import math
from typing import cast

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from archon.config import ConfigError, OptimizerConfig

LOW_BIT_ADAMW = {"adamw_8bit": "AdamW8bit", "adamw_fp8": "AdamWFp8"}
"""``OptimizerConfig.type`` values served by torchao's low-bit AdamW (``torchao.optim``) and their class names."""


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (DTensors included); torchao's low-bit AdamW for its ``type``s."""
    params = [p for p in params if p.requires_grad]
    if cfg.type in LOW_BIT_ADAMW:
        return build_low_bit_adamw(params, cfg)
    # The fused kernel (CUDA and CPU) updates each tensor in one pass; on CPU it is ~5x faster than
    # the foreach kernels.  Fused and foreach kernels group tensors by device/dtype and take DTensors
    # on one mesh, but not DTensors mixed with plain tensors (a transformers model under TP without
    # FSDP keeps its unplanned parameters plain): then the per-parameter loop.  One param group
    # either way, so optimizer checkpoints load under any allocation.
    mixed = any(isinstance(p, DTensor) for p in params) and not all(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=cast("tuple[float, float]", tuple(cfg.betas)),  # OptimizerConfig.betas holds two
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **({"foreach": False} if mixed else {"fused": True}),
    )


def build_low_bit_adamw(params: list[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """torchao's 8-bit or fp8-state AdamW: each state tensor of >= 4096 values in blocks of 256 with a float32 scale
    per block (``archon/plan/optimizer_memory.py`` counts it); smaller tensors keep full-precision state."""
    try:
        # torchao is the optional `fp8` extra and slow to import: loaded only for a low-bit optimizer.
        optim = importlib.import_module("torchao.optim")
    except ImportError:
        raise ConfigError(
            f"optimizer.type = '{cfg.type}' needs torchao; pip install 'archon[fp8]' or use type = 'adamw'"
        ) from None
    return getattr(optim, LOW_BIT_ADAMW[cfg.type])(
        params,
        lr=cfg.lr,
        betas=cast("tuple[float, float]", tuple(cfg.betas)),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


def lr_multiplier(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Factor on ``cfg.lr`` before optimizer step ``step`` (0-based)."""
    warmup = cfg.warmup_steps
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if cfg.lr_schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))
