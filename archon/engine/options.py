"""The typed options an engine hands to ``parallel/`` and ``pipeline/``, built once from its config.

Model packages and ``pipeline/`` read ``ParallelizeOptions`` and ``PipelineOptions``, never
Archon's config, so they depend on nothing above ``parallel/``.
"""

from __future__ import annotations

import torch

from archon.config import ConfigError, TrainEngineConfig
from parallel.options import ParallelizeOptions
from pipeline import PipelineOptions


def parallelize_options(cfg: TrainEngineConfig) -> ParallelizeOptions:
    """``ParallelizeOptions`` of an engine config (activation checkpointing only with ``gradient_checkpointing``)."""
    archon = cfg.archon
    return ParallelizeOptions(
        param_dtype=cfg.dtype,
        reduce_dtype=cfg.grad_reduce_dtype,
        ac_mode=archon.ac_mode if cfg.gradient_checkpointing else "none",
        selective_ac_option=archon.selective_ac_option,
        ac_memory_budget=archon.ac_memory_budget,
        ac_debug=archon.ac_debug,
        enable_compile=archon.enable_compile,
        cpu_offload=archon.offload_params,
        reshard_after_forward_policy=archon.reshard_after_forward_policy,
        deterministic=archon.use_deterministic_algorithms,
        moe_router_dtype=archon.moe_router_dtype,
    )


def pipeline_options(cfg: TrainEngineConfig) -> PipelineOptions:
    """``PipelineOptions`` of an engine config (used when its allocation has p > 1)."""
    return PipelineOptions(schedule=cfg.archon.pp_schedule, layers_per_stage=cfg.archon.pp_layers_per_stage)


def parameter_device(compute: torch.device, cpu_offload: bool, fsdp_enabled: bool, where: str) -> torch.device:
    """Where a meta-device model's parameters are materialised: the CPU under offload, else ``compute``.

    FSDP2's ``CPUOffloadPolicy`` keeps the sharded parameters (and so gradients and optimizer
    state) on the CPU and copies each unit to the compute device for its all-gather; it refuses
    parameters materialised anywhere else ("FSDP parameters should be materialized on CPU").
    Buffers are not FSDP's: they stay on ``compute``.  Offload needs FSDP to act on, so a layout
    without it (``d*c = 1``) is refused rather than left with parameters the GPU cannot reach.
    """
    if not cpu_offload:
        return compute
    if not fsdp_enabled:
        raise ConfigError(
            f"{where}: archon.offload_params = true offloads FSDP-sharded parameters, but this allocation "
            "shards none (its d*c is 1); turn offload_params off or give the allocation d > 1"
        )
    return torch.device("cpu")
