"""An engine model's weights by plain name (wrapper prefixes removed): in, initialised, and out.

Initial weights never depend on the allocation: full tensors are drawn the same way on every
rank and each rank keeps its shard.  Going out, every tensor is gathered to its full shape
(from the pipeline stage holding it) and renamed to the model's Hugging Face names.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from archon.config import ConfigError
from models import get_model_spec, read_hf_config, save_hf_tensors
from models.lora import merge_adapters
from parallel.fqn import clean_fqn
from pipeline import PipelinedModel


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
        local = distribute_tensor(
            full.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full.to(target.device, target.dtype))


@torch.no_grad()
def init_from_seed(model: torch.nn.Module, build_full: Callable[[], torch.nn.Module], seed: int) -> None:
    """Initialise ``model`` (maybe sharded) as ``build_full()`` initialises a full copy seeded by ``seed``."""
    torch.manual_seed(seed)
    full = build_full()
    cast(Any, full).init_weights()  # an Archon model (models/)
    full_sd = dict(full.named_parameters())
    for name, tensor in named_state(model):
        copy_full_into(tensor, full_sd[name])


@torch.no_grad()
def init_unloaded(model: torch.nn.Module, names: Iterable[str], seed: int, std: float) -> None:
    """Seeded init of tensors a checkpoint legitimately lacks (a critic's value head).

    Drawn as full tensors from a generator seeded by the run seed and the name, then sharded,
    so the values do not depend on the allocation.
    """
    params = dict(named_state(model))
    for name in names:
        if name not in params:  # a buffer (the MoE routing bias) keeps init_buffers' value
            continue
        target = params[name]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, name)))
        full = torch.empty(target.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        copy_full_into(target, full)


def full_tensors(
    model: torch.nn.Module, pipeline: PipelinedModel | None
) -> tuple[set[str], Iterator[tuple[str, torch.Tensor]]]:
    """The names of the persistent buffers, and (Archon name, full tensor) of every parameter and persistent
    buffer of the full model, one at a time in one order on every rank; a collective."""
    local = dict(named_state(model, buffers=False))
    local.update(persistent_buffers(model))
    if pipeline is not None:
        buffers = {info.name for info in pipeline.full_tensors if info.is_buffer}
        # Each tensor comes from the stage holding it, in the full model's order.
        return buffers, pipeline.named_full_tensors(local)
    buffers = set(persistent_buffers(model))
    return buffers, ((name, t.full_tensor() if isinstance(t, DTensor) else t) for name, t in local.items())


def hf_full_tensors(
    model: torch.nn.Module,
    adapter: Any,
    pipeline: PipelinedModel | None,
    dtype: torch.dtype | None = None,
    extras: bool = False,
    lora_scales: dict[str, float] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of ``model`` one at a time, through its state-dict ``adapter``; a collective.

    Parameters are cast to ``dtype``.  ``extras`` adds the persistent buffers HF formats may
    lack (the MoE routing bias, in float32) under the names Archon's own server reads;
    without it only the fields of the model's HF architecture come out.  ``lora_scales`` (adapted
    module name -> scale) merges LoRA adapters into their layers' weights (``models.lora.merge_adapters``).
    """
    buffers, tensors = full_tensors(model, pipeline)
    if lora_scales:
        tensors = merge_adapters(tensors, lora_scales)
    for name, full in tensors:
        full = full.detach()
        if name in buffers:
            items = adapter.to_hf_tensors(name, full)
        else:
            items = adapter.to_hf_tensors(name, full.to(dtype) if dtype is not None else full)
        for hf_name, value in items:
            if extras or adapter.is_hf_field(hf_name):
                yield hf_name, value


def write_hf_folder(
    tensors: Iterator[tuple[str, torch.Tensor]],
    hf_config: dict[str, Any],
    path: str | Path,
    source: str = "",
    max_shard_size: str | int = "5GB",
) -> None:
    """Rank 0 writes ``tensors`` (a collective iterator every rank drains) and ``hf_config`` as an HF folder.

    ``source``'s ``generation_config.json`` (EOS ids, sampling defaults) is copied along.
    """
    on_cpu = ((n, t.cpu()) for n, t in tensors)
    if dist.get_rank() == 0:
        save_hf_tensors(on_cpu, hf_config, path, max_shard_size=max_shard_size)
        generation_config = Path(source) / "generation_config.json" if source else None
        if generation_config is not None and generation_config.is_file():
            # EOS ids and sampling defaults live here; generate() and servers read them.
            shutil.copyfile(generation_config, Path(path) / "generation_config.json")
    else:
        for _ in on_cpu:  # join the collectives
            pass
    dist.barrier()


def load_hf_config(name: str, source: str, check_spec: bool) -> Any:
    """The transformers config of the HF folder (or config.json) ``source``, for engine ``name``.

    ``check_spec``: first check that Archon has a model for its ``model_type`` (Archon's sentence
    for an unsupported model, before transformers' paragraph about it).
    """
    from transformers import AutoConfig

    if not source:
        raise ConfigError(
            f"{name}.path is empty and {name}.model_config is empty; set one to an "
            "HF model folder (path loads its weights, model_config only its architecture)"
        )
    p = Path(source)
    folder = p.parent if p.name == "config.json" else p
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"{name}: no config.json in '{folder}'; point {name}.path at a Hugging Face "
            "model folder (config.json + *.safetensors)"
        )
    if check_spec:
        get_model_spec(read_hf_config(folder).get("model_type", ""))
    return AutoConfig.from_pretrained(str(folder))
