"""FSDP2 (``fully_shard``) over the data-parallel mesh, with mixed precision and CPU offload."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from parallel.dtypes import to_dtype
from parallel.errors import ParallelConfigError


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """default: reshard unless pipeline parallel (its microbatches would all-gather again each time)."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default":
        return not pp_enabled
    raise ParallelConfigError(f"reshard_after_forward_policy '{policy}' must be default, always or never")


def fsdp_policies(
    param_dtype: str | torch.dtype, reduce_dtype: str | torch.dtype, cpu_offload: bool
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The mixed-precision and offload policies every FSDP unit of an engine shares."""
    mp = MixedPrecisionPolicy(param_dtype=to_dtype(param_dtype), reduce_dtype=to_dtype(reduce_dtype))
    # Pinned host memory needs an accelerator; on a CPU-only machine offload is the identity anyway.
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    return mp, offload


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    units: Iterable[nn.Module | list[nn.Module]],
    *,
    param_dtype: str | torch.dtype = torch.float32,
    reduce_dtype: str | torch.dtype = torch.float32,
    pp_enabled: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
    shard_root: bool = True,
) -> nn.Module:
    """Shard each unit (a module, or a list of modules sharded as one group), then the root.

    ``dp_mesh`` is 1-D (FSDP over dp_shard*cp) or 2-D ``[dp_replicate, dp_shard_cp]`` (HSDP).
    The root's reshard flag is False: its parameters are needed again right at backward.
    ``shard_root=False`` only makes the units (inner units with their own mixed precision,
    made before the outer ones).
    """
    mp, offload = fsdp_policies(param_dtype, reduce_dtype, cpu_offload)
    reshard = reshard_after_forward(reshard_after_forward_policy, pp_enabled)
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    if shard_root:
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    return model


@contextmanager
def gathered_parameters(model: nn.Module) -> Iterator[None]:
    """Collective: every FSDP unit of ``model`` holds its whole parameters until the block ends.

    Inside, a forward of ``model`` all-gathers nothing, so one rank may run as many forwards as it
    likes alone (generation on the training weights: ``archon.rl.inprocess``); the other ranks only
    wait.  On exit every unit is resharded and gets back its reshard-after-forward setting.  Without
    FSDP units this does nothing.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # Each unit's own setting (the root keeps its parameters after forward, blocks by policy); FSDP2 exposes no
    # getter, so it is read from the unit's parameter group.
    saved = [_reshard_setting(unit) for unit in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        # Forwards without a backward leave per-iteration trackers behind (the post-forward order that backward
        # prefetching follows) on the ranks that ran them only; training would then prefetch in another order on
        # each rank.  reset_iter_state clears them and reshards every unit.
        for unit in units:
            if unit._get_fsdp_state()._is_root:
                unit.reset_iter_state()
        for unit, setting in zip(units, saved):
            unit.reshard()
            unit.set_reshard_after_forward(setting, recurse=False)


def _reshard_setting(unit: FSDPModule) -> bool:
    groups = unit._get_fsdp_state()._fsdp_param_groups
    return bool(groups[0]._reshard_after_forward) if groups else False
