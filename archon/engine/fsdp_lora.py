"""LoRA on the ``fsdp:`` engine through the real ``peft`` library (the ``lora`` extra).

The adapters are injected into the transformers model in place (``peft.inject_adapter_in_model``, no
``PeftModel`` wrapper, so the blocks, tied embeddings and FSDP units stay where the engine finds them),
before FSDP wraps it.  Only adapter parameters (and a critic's score head) require grad.  Going out,
each adapted layer's weight is merged (``W + alpha / r * B @ A``) under its transformers name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from archon.config import ConfigError
from archon.config.lora import LoRAConfig
from models.common.lora import merge_lora_weight
from models.lora import ALL_LINEAR

_BASE = ".base_layer."
_A, _B = ".lora_A.default.weight", ".lora_B.default.weight"


def peft_lora_config(cfg: LoRAConfig) -> Any:
    """PEFT's ``LoraConfig`` for ``cfg`` (the same names: r, lora_alpha, lora_dropout, target_modules)."""
    try:
        from peft import LoraConfig  # optional dependency: the `lora` extra
    except ImportError:
        raise ConfigError(
            "lora.enabled on an fsdp: engine needs the peft package; pip install 'archon[lora]'"
        ) from None
    targets: str | list[str] = ALL_LINEAR if ALL_LINEAR in cfg.target_modules else list(cfg.target_modules)
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        init_lora_weights=cfg.init_lora_weights,
        bias="none",
    )


def inject_lora(model: torch.nn.Module, cfg: LoRAConfig, trainable_head: str | None = None) -> None:
    """Give ``model`` PEFT adapters in place and freeze everything else (but ``trainable_head``'s parameters)."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_lora_config(cfg), model)
    for name, param in model.named_parameters():
        head = trainable_head is not None and name.startswith(trainable_head + ".")
        param.requires_grad_(".lora_A." in name or ".lora_B." in name or head)


@contextmanager
def peft_adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """PEFT's ``disable_adapter`` for a model with injected adapters (there is no ``PeftModel`` to call it on):
    inside it every adapted layer computes its base layer alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # optional dependency: the `lora` extra

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    # PEFT's switch also sets the adapters' requires_grad; put back what the engine chose (frozen engines stay so).
    requires_grad = {p: p.requires_grad for layer in layers for p in layer.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in requires_grad.items():
            p.requires_grad_(flag)


def merge_peft_tensors(tensors: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, full tensor) with PEFT's adapted layers merged and renamed to the base model's names."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if name.endswith((_A, _B)) or name.endswith(_BASE + "weight"):
            suffix = next(s for s in (_A, _B, _BASE + "weight") if name.endswith(s))
            module = name[: -len(suffix)]
            parts = held.setdefault(module, {})
            parts[suffix] = tensor
            if len(parts) == 3:
                del held[module]
                merged = merge_lora_weight(parts[_BASE + "weight"], parts[_A], parts[_B], scale)
                yield f"{module}.weight", merged
            continue
        yield name.replace(_BASE, "."), tensor
    assert not held, f"adapted layers without all of base weight, lora_A, lora_B: {sorted(held)}"
