"""Where an engine runs, set up the same way by every engine: device, process group, allocation and meshes.

``init_layout`` is the first thing ``initialize`` does: it checks the torch floor, picks the
device, joins the process group, checks the allocation against the engine and the job size,
builds ``ParallelDims`` and its device meshes, and logs them.  ``EngineLayout`` then answers
what the training loop asks of the layout (data-parallel size, rank and group; autocast).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from archon.alloc import ModelAllocation
from archon.config import ConfigError, TrainEngineConfig
from archon.engine.dist import current_device, init_distributed, resolve_device_type
from archon.engine.errors import EngineError
from archon.engine.options import parallelize_options
from archon.engine.torch_floor import check_torch_version
from archon.engine.weights import load_hf_config
from parallel.determinism import apply_determinism
from parallel.dims import ParallelDims
from parallel.dtypes import to_dtype
from parallel.errors import ParallelConfigError
from parallel.options import ParallelizeOptions

logger = logging.getLogger("archon.engine")


@dataclass
class EngineLayout:
    """One engine's place on the ranks."""

    device_type: str
    """``cuda`` or ``cpu``."""
    device: torch.device
    """This rank's compute device."""
    allocation: ModelAllocation
    """The parsed allocation string (``config.backend``)."""
    parallel_dims: ParallelDims
    """The parallel sizes, with their device meshes built."""
    options: ParallelizeOptions
    """What ``parallel/`` and ``pipeline/`` are told besides the sizes (dtypes, AC, compile, offload)."""

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (replicas times shards): the number of shares a batch is cut into."""
        pd = self.parallel_dims
        return pd.dp_replicate * pd.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel share."""
        if self.dp_size == 1:
            return 0
        return self.parallel_dims.get_mesh("dp").get_local_rank()

    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group; None with one data-parallel rank."""
        return self.parallel_dims.get_mesh("dp").get_group() if self.dp_size > 1 else None

    def autocast(self, dtype: str) -> AbstractContextManager[Any]:
        """Mixed precision where FSDP's policy does not apply (one data-parallel rank, TP only).

        FSDP casts parameters to ``dtype`` for compute; without FSDP the same ``dtype`` setting
        must still mean low-precision matmuls, so autocast provides them (as torchtitan does).
        """
        compute = to_dtype(dtype)
        if compute == torch.float32 or self.parallel_dims.fsdp_enabled:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=compute)


def init_layout(
    config: TrainEngineConfig,
    *,
    name: str,
    device: str,
    allocation: ModelAllocation | None,
    backend: str,
    engine_class: str,
    engine_label: str,
) -> EngineLayout:
    """Device, process group, allocation and device meshes of engine ``name`` (``engine_class``, running
    ``backend:`` allocations); ``allocation`` is ``config.backend`` already parsed, or None to parse it here."""
    check_torch_version()
    device_type = resolve_device_type(device)
    if config.archon.use_deterministic_algorithms:
        # Environment variables must be set before the first kernel/communicator exists.
        apply_determinism(device_type)
    # The entry points already joined with the GPU the cluster plan gives this rank (init_run).
    init_distributed(device_type)
    compute = current_device(device_type)
    alloc = allocation or ModelAllocation.from_str(config.backend)
    options = parallelize_options(config)
    if alloc.backend != backend:
        raise EngineError(
            f"{name}.backend = '{config.backend}' is a '{alloc.backend}:' allocation, "
            f"but {engine_class} runs '{backend}:' ones; build engines with "
            "archon.engine.build_engine(config, ...), which picks the engine by backend"
        )
    world = dist.get_world_size()
    if alloc.world_size != world:
        raise EngineError(
            f"{name}.backend = '{config.backend}' needs {alloc.world_size} ranks but "
            f"the job has {world}; launch with --nproc_per_node={alloc.world_size} "
            f"or change the allocation"
        )
    try:
        parallel_dims = ParallelDims.from_allocation(alloc, dp_replicate=config.archon.dp_replicate)
    except ParallelConfigError as exc:  # parallel/ cannot raise Archon's errors
        raise EngineError(f"{name}.backend = '{config.backend}': {exc}") from None
    parallel_dims.build_meshes(device_type)
    if dist.get_rank() == 0:
        logger.info("Initialized %s engine with parallel dims: %s", engine_label, parallel_dims.describe())
    return EngineLayout(device_type, compute, alloc, parallel_dims, options)


def load_model_config(name: str, config: TrainEngineConfig, check_spec: bool) -> Any:
    """The transformers config of engine ``name``'s model (``path``, else ``model_config``).

    ``check_spec``: first check that Archon has a model for its ``model_type`` (the ``archon:`` engine).
    """
    try:
        return load_hf_config(name, config.path or config.model_config, check_spec)
    except ConfigError as exc:
        raise EngineError(str(exc)) from None
