"""Global gradient-norm clipping that is correct for DTensor (FSDP/TP), pipeline stages and expert meshes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _norm_pow(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Sum over ``grads`` of ||g||^p, reduced over the DTensor meshes the grads live on."""
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_mesh[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite=False, foreach=None)
        if isinstance(norm, DTensor):
            # Sharded/partial placements are reduced by DTensor itself.
            norm = norm.full_tensor()
        total = total + norm.float().to(total.device) ** norm_type
    return total


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip in place and return the total norm (float32 scalar, identical on every rank).

    Grads on different meshes (e.g. experts on the expert mesh, the rest on the dense mesh) are
    reduced separately and summed; pipeline stages hold disjoint parameters, so their p-th
    powers are summed over ``pp_group``.  ``max_norm <= 0`` only measures.  A non-finite norm
    leaves the grads untouched: the caller skips the step.
    """
    grads = [g for p in parameters if (g := p.grad) is not None]
    total = _norm_pow(grads, norm_type) if grads else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total_norm = total ** (1.0 / norm_type)
    if max_norm > 0 and grads:
        # The factor stays a tensor (1 for a non-finite norm): reading the norm here would make the
        # host wait for the GPU, and the caller reads it once anyway.
        scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        scale = torch.where(torch.isfinite(total_norm), scale, torch.ones_like(scale))
        by_group: dict[tuple[torch.device, object], list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_group[(g.device, g.device_mesh if isinstance(g, DTensor) else None)].append(g)
        for (device, _), group in by_group.items():
            torch._foreach_mul_(group, scale.to(device))  # pyright: ignore[reportPrivateImportUsage]
    return total_norm
