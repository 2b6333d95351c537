"""An engine model's tensors by their plain names (wrapper prefixes removed), and copying full tensors in."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from parallel.fqn import clean_fqn


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers (the MoE routing bias) by wrapper-free name."""
    out = {}
    for mod_name, mod in model.named_modules():
        for buf_name, buf in mod.named_buffers(prefix=mod_name, recurse=False):
            if buf is not None and buf_name.rsplit(".", 1)[-1] not in mod._non_persistent_buffers_set:
                out[clean_fqn(buf_name)] = buf
    return out


def named_state(model: torch.nn.Module, buffers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (and persistent buffers) with wrapper prefixes (AC, compile) removed."""
    items = list(model.named_parameters())
    if buffers:
        items += list(model.named_buffers())
    for name, tensor in items:
        yield clean_fqn(name), tensor


@torch.no_grad()
def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter that may be a DTensor shard (no communication)."""
    if isinstance(target, DTensor):
        local = distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full.to(target.device, target.dtype))
