"""What a model's parallelize function needs besides the mesh sizes: one engine's options, typed.

The engine builds one ``ParallelizeOptions`` from its config and hands it to
``parallelize_<model>(model, parallel_dims=..., options=...)``; model packages and
``pipeline/`` read these fields and never the engine's config, so they depend on
``parallel/`` and nothing above it.  The defaults are a plain float32 model: no activation
checkpointing, no compile, no offload.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from parallel.dims import ParallelDims
from parallel.dtypes import to_dtype


@dataclass(frozen=True)
class ParallelizeOptions:
    """How the techniques of ``parallel/`` are applied to one engine's model (the sizes are ``ParallelDims``)."""

    param_dtype: str = "float32"
    """Compute dtype of parameters under FSDP's mixed precision (master weights stay float32)."""
    reduce_dtype: str = "float32"
    """dtype of FSDP's gradient reduce-scatter / all-reduce."""
    ac_mode: str = "none"
    """Activation checkpointing of the blocks: 'none', 'full', 'selective' or 'memory_budget'."""
    selective_ac_option: str = "op"
    """For ac_mode 'selective': 'op' (save matmul and attention outputs) or N (checkpoint every Nth block)."""
    ac_memory_budget: float = 0.5
    """For ac_mode 'memory_budget' (needs compile): 0.0 recomputes everything, 1.0 nothing."""
    ac_debug: bool = False
    """Log which activations activation checkpointing saves and which it recomputes."""
    enable_compile: bool = False
    """torch.compile each block (after activation checkpointing, before FSDP)."""
    cpu_offload: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state on the CPU."""
    reshard_after_forward_policy: str = "default"
    """FSDP resharding after forward: 'default' (except under pipeline parallel), 'always' or 'never'."""
    deterministic: bool = False
    """Deterministic algorithms: activation checkpointing then replays the RNG state in recompute."""
    moe_router_dtype: str = "auto"
    """dtype of MoE router gates: 'auto' follows ``param_dtype``; 'float32' keeps them in float32."""

    @property
    def ac_enabled(self) -> bool:
        """Activation checkpointing wraps (or, under 'memory_budget', compiles) the blocks."""
        return self.ac_mode != "none"

    @property
    def router_dtype(self) -> torch.dtype | None:
        """The dtype router gates are pinned to, or None when they follow ``param_dtype``."""
        return None if self.moe_router_dtype in ("auto", "") else to_dtype(self.moe_router_dtype)

    def without_compile(self) -> ParallelizeOptions:
        """The same options with torch.compile off (for stages a schedule cannot run compiled)."""
        return dataclasses.replace(self, enable_compile=False)


class ParallelizeFn(Protocol):
    """``ModelSpec.parallelize_fn``: lay a meta-device model (or one pipeline stage of it) over the meshes of
    ``parallel_dims`` as ``options`` say, in place; returns the model."""

    def __call__(self, model: nn.Module, *, parallel_dims: ParallelDims, options: ParallelizeOptions) -> nn.Module: ...
