"""LoRA on the ``archon:`` engine: adapters put into the model before it is laid over the ranks, their
seeded init, the frozen base's dtype, and the PEFT adapter folder.

The base stays frozen in the training dtype (``actor.dtype``) without gradients or optimizer state; the
adapters are float32 master weights, the only parameters the optimizer sees.  Adapters are drawn as full
tensors from a generator seeded by the run seed and the layer's name, then each rank keeps its shard, so
their initial values do not depend on the allocation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from archon.config import ConfigError
from archon.config.lora import LoRAConfig
from archon.engine.weights import copy_full_into, full_tensors
from models.common.lora import LoRALinear, init_lora_tensors
from models.lora import LoRAStateDictAdapter, apply_lora, is_lora_name, peft_names
from models.state_dict_adapter import BaseStateDictAdapter
from parallel.dtypes import to_dtype
from parallel.fqn import clean_fqn
from pipeline import PipelinedModel

ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter config file."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""PEFT's adapter weights file."""


def check_lora(cfg: LoRAConfig, where: str) -> None:
    """Raise ``ConfigError`` for a LoRA section that cannot run (``where`` names it, e.g. ``actor.lora``)."""
    if cfg.peft_type.lower() != "lora":
        raise ConfigError(f"{where}.peft_type = '{cfg.peft_type}': only 'lora' is supported; set it to 'lora'")
    if cfg.rank <= 0:
        raise ConfigError(f"{where}.rank = {cfg.rank} must be a positive integer; 8 or 16 are usual")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"{where}.dropout = {cfg.dropout} must be in [0, 1)")
    if not cfg.target_modules:
        raise ConfigError(f"{where}.target_modules is empty; name HF modules such as q_proj, v_proj, or 'all-linear'")


def add_adapters(
    model: torch.nn.Module,
    adapter: BaseStateDictAdapter,
    cfg: LoRAConfig,
    dtype: str,
    where: str,
    trainable_head: bool = False,
) -> dict[str, str]:
    """Freeze the meta-device ``model``, give the targeted layers adapters and store the frozen base in ``dtype``.

    ``trainable_head`` keeps the output layer trainable (a critic's value head has no pretrained value).
    Returns ``{Archon module name: HF module name}`` of the adapted layers.
    """
    check_lora(cfg, where)
    try:
        targets = apply_lora(
            model, adapter, list(cfg.target_modules), rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout
        )
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    base_dtype = to_dtype(dtype)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.requires_grad and param.dtype != base_dtype and not is_lora_name(name):
                # Frozen: no master copy needed, it is kept in the dtype it computes in.
                module.register_parameter(name, torch.nn.Parameter(param.data.to(base_dtype), requires_grad=False))
    head = getattr(model, "output", None)
    if trainable_head and isinstance(head, torch.nn.Module):
        head.float().requires_grad_(True)
    return targets


@torch.no_grad()
def init_adapters(model: torch.nn.Module, seed: int, cfg: LoRAConfig) -> None:
    """Seeded PEFT init of every adapter (A Kaiming-uniform, B zero unless ``init_lora_weights`` is false)."""
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        name = clean_fqn(name)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, name)) + 7)
        a, b = init_lora_tensors(
            module.in_features, module.out_features, module.rank, gen, zero_b=cfg.init_lora_weights
        )
        copy_full_into(module.lora_a, a)
        copy_full_into(module.lora_b, b)


def lora_adapter(adapter: BaseStateDictAdapter) -> LoRAStateDictAdapter:
    """``adapter`` with LoRA parameters known (optional in HF checkpoints, left out of HF tensors)."""
    return LoRAStateDictAdapter(adapter)


def peft_tensors(
    model: torch.nn.Module, pipeline: PipelinedModel | None, targets: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT key, full float32 tensor) of every adapter; a collective every rank drains."""
    _, tensors = full_tensors(model, pipeline)
    for name, full in tensors:
        module, _, leaf = name.rpartition(".")
        if module in targets and is_lora_name(leaf):
            yield peft_names(targets[module])[leaf], full.detach().float().cpu().contiguous()


def peft_config(cfg: LoRAConfig, targets: dict[str, str], base_path: str) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for adapters on ``targets`` (their HF module names)."""
    names = sorted({hf.rsplit(".", 1)[-1] for hf in targets.values()})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": names,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": cfg.init_lora_weights,
    }


def write_peft_folder(tensors: Iterator[tuple[str, torch.Tensor]], config: dict[str, Any], path: str | Path) -> None:
    """Rank 0 writes a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``); collective."""
    items = dict(tensors)  # every rank drains the collective iterator; adapters are small
    if dist.get_rank() == 0:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(items, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    dist.barrier()
