"""LoRA on an Archon model: which layers get adapters (by their Hugging Face names), and the names adapters
have in a checkpoint of the HF model, in PEFT's layout.

``apply_lora`` swaps the selected ``Linear`` layers of a built (usually meta-device) model for
``LoRALinear`` before ``parallelize_<model>`` sees it, so tensor parallel, FSDP, pipeline stages,
activation checkpointing and compile all act on the adapted model.  Targets are matched against the HF
module name of each layer (``model.layers.0.self_attn.q_proj``) as PEFT matches them (the whole name or its
last parts), or against Archon's own module name (``layers.0.attention.wq``).  Never adapted: the LM head
(``output``), MoE routers and grouped experts (they are not linear layers), embeddings and norms.

``LoRAStateDictAdapter`` wraps a model's adapter: HF checkpoints hold no adapters, so they are optional
when loading and left out of HF tensors; ``peft_names`` gives PEFT's keys for them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from models.common.lora import LoRALinear, merge_lora_weight
from models.state_dict_adapter import BaseStateDictAdapter, HFKeyTarget, UnknownKeyError

ALL_LINEAR = "all-linear"
"""PEFT's shorthand target: every linear layer of the blocks (not the LM head, nor MoE routers or experts)."""
LORA_PARAMS = ("lora_a", "lora_b")
"""Parameter names of an adapter inside its ``LoRALinear``."""
PEFT_PARAMS = {"lora_a": "lora_A", "lora_b": "lora_B"}
"""Archon adapter parameter -> PEFT's sub-module name (its tensor is ``<name>.weight``)."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the transformers model's own names in an adapter file."""
_NEVER = re.compile(r"(^|\.)(output|moe)(\.|$)")


def is_lora_name(name: str) -> bool:
    """True for an adapter parameter's name (``layers.0.attention.wq.lora_a``)."""
    return name.rsplit(".", 1)[-1] in LORA_PARAMS


def _hf_module_name(adapter: BaseStateDictAdapter, fqn: str, shape: torch.Size) -> str | None:
    try:
        items = adapter.to_hf_tensors(f"{fqn}.weight", torch.empty(shape, device="meta"))
    except (UnknownKeyError, NotImplementedError):
        # No single HF module behind this layer (Archon's own, or one the adapter does not map): not a PEFT target.
        return None
    if len(items) != 1 or not items[0][0].endswith(".weight"):
        return None
    return items[0][0][: -len(".weight")]


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_targets(model: nn.Module, adapter: BaseStateDictAdapter, targets: list[str]) -> dict[str, str]:
    """``{archon module name: HF module name}`` of the linear layers ``targets`` select (PEFT's matching)."""
    if not targets:
        raise ValueError("lora.target_modules is empty; name HF modules such as q_proj and v_proj, or 'all-linear'")
    everything = ALL_LINEAR in targets
    found: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if type(module) is LoRALinear or not isinstance(module, nn.Linear) or _NEVER.search(fqn):
            continue
        hf = _hf_module_name(adapter, fqn, module.weight.shape)
        if hf is None:
            continue
        if everything or _matches(hf, targets) or _matches(fqn, targets):
            found[fqn] = hf
    if not found:
        raise ValueError(
            f"lora.target_modules = {targets} selects no linear layer of {type(model).__name__}; "
            "name HF modules such as q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or 'all-linear'"
        )
    return found


def apply_lora(
    model: nn.Module,
    adapter: BaseStateDictAdapter,
    targets: list[str],
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
) -> dict[str, str]:
    """Freeze ``model`` and put a ``LoRALinear`` in place of every targeted layer; returns the targets' names.

    Call it on the built model before parallelizing or splitting it into pipeline stages.
    """
    if rank <= 0:
        raise ValueError(f"lora.rank = {rank} must be a positive integer (8 or 16 are usual)")
    found = lora_targets(model, adapter, targets)
    model.requires_grad_(False)
    for fqn in found:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        setattr(parent, child, LoRALinear.from_linear(base, rank=rank, alpha=alpha, dropout=dropout))
    return found


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The ``LoRALinear`` layers of ``model`` by module name (wrapper parts kept)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within it, every ``LoRALinear`` of ``model`` computes its frozen base layer alone (``W x``, adapters off).

    The base model without a second copy of its weights: the RL reference of a LoRA actor.  The switch is a
    Python attribute of each layer, so it acts the same under FSDP2, tensor parallel and pipeline stages (each
    rank turns off its own layers; a pipeline stage without adapted layers has nothing to do); under torch.compile
    it is a guard, so the first use recompiles once.
    """
    layers = list(lora_modules(model).values())
    before = [layer.adapter_enabled for layer in layers]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer, enabled in zip(layers, before, strict=True):
            layer.adapter_enabled = enabled


def peft_names(hf_module: str) -> dict[str, str]:
    """PEFT's adapter-file keys of the adapter on HF module ``hf_module``, by Archon parameter name."""
    return {p: f"{PEFT_PREFIX}{hf_module}.{peft}.weight" for p, peft in PEFT_PARAMS.items()}


def merge_adapters(
    tensors: Iterable[tuple[str, torch.Tensor]], scales: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` pairs with each adapted layer's weight merged (``W + scale * B @ A``), adapters dropped.

    ``scales`` maps adapted module names to their scale.  A layer's ``weight``, ``lora_a`` and ``lora_b`` are held
    until all three have come (they come one after another in parameter order), then its merged weight comes.
    """
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if module not in scales or leaf not in ("weight", *LORA_PARAMS):
            yield name, tensor
            continue
        parts = held.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) == 3:
            del held[module]
            yield (
                f"{module}.weight",
                merge_lora_weight(parts["weight"], parts["lora_a"], parts["lora_b"], scales[module]),
            )
    assert not held, f"adapted layers without all of weight, lora_a, lora_b: {sorted(held)}"


class LoRAStateDictAdapter(BaseStateDictAdapter):
    """A model's adapter with LoRA parameters known: optional when loading HF weights, absent from HF tensors."""

    def __init__(self, base: BaseStateDictAdapter) -> None:
        super().__init__(base.model_args)
        self.base = base

    def map_hf_key(self, hf_name: str) -> tuple[str, int | None] | None:
        return self.base.map_hf_key(hf_name)

    def hf_key_targets(self, hf_name: str) -> list[HFKeyTarget]:
        return self.base.hf_key_targets(hf_name)

    def to_hf_tensors(self, archon_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if is_lora_name(archon_name):
            return []  # not a field of the HF architecture; merged into the weight or exported for PEFT
        return self.base.to_hf_tensors(archon_name, tensor)

    def num_experts_of(self, archon_name: str) -> int:
        return self.base.num_experts_of(archon_name)

    def is_optional(self, archon_name: str) -> bool:
        return is_lora_name(archon_name) or self.base.is_optional(archon_name)

    def is_hf_field(self, hf_name: str) -> bool:
        return self.base.is_hf_field(hf_name)

    def hf_module_of(self, archon_module: str, weight_shape: Any) -> str | None:
        """The HF module name of Archon module ``archon_module`` (whose weight has ``weight_shape``)."""
        return _hf_module_name(self.base, archon_module, torch.Size(weight_shape))
