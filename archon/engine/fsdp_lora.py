"""LoRA on the ``fsdp:`` engine through the real ``peft`` library (the ``lora`` extra).

The adapters are injected into the transformers model in place (``peft.inject_adapter_in_model``, no
``PeftModel`` wrapper, so the blocks, tied embeddings and FSDP units stay where the engine finds them),
before FSDP wraps it.  Only adapter parameters (and a critic's score head) require grad.  Going out,
each adapted layer's weight is merged (``W + alpha / r * B @ A``) under its transformers name.

Under tensor parallel an adapted layer is placed as a whole by its base layer's style (``with_peft_placements``):
the base weight splits as usual and the adapter follows it, as Archon's own ``LoRAColwiseParallel`` /
``LoRARowwiseParallel`` place ``LoRALinear``.  Every parameter of the layer is a DTensor and PEFT's forward runs
on DTensors, so DTensor's autograd sums the partial gradients a replicated adapter weight gets on each TP rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from archon.config import ConfigError
from archon.config.lora import LoRAConfig
from models.common.lora import merge_lora_weight
from models.lora import ALL_LINEAR, PEFT_PREFIX

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


def peft_adapter_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT adapter-file key, float32 tensor) of every adapter in ``(transformers name, full tensor)`` pairs: the
    injected ``<module>.lora_A.default.weight`` becomes ``base_model.model.<module>.lora_A.weight``."""
    for name, tensor in tensors:
        for suffix, peft in ((_A, ".lora_A.weight"), (_B, ".lora_B.weight")):
            if name.endswith(suffix):
                yield f"{PEFT_PREFIX}{name[: -len(suffix)]}{peft}", tensor.detach().float().cpu().contiguous()


def adapted_modules(model: nn.Module) -> dict[str, str]:
    """``{module name: module name}`` of the layers PEFT adapted (the shape ``peft_config`` takes)."""
    return {name: name for name, module in model.named_modules() if is_peft_linear(module)}


# ------------------------------------------------------------------------------ tensor parallel
def is_peft_linear(module: nn.Module) -> bool:
    """True for a PEFT LoRA layer around an ``nn.Linear`` (``base_layer``, ``lora_A``/``lora_B`` per adapter)."""
    return isinstance(getattr(module, "base_layer", None), nn.Linear) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict
    )


def check_not_peft(module: nn.Module) -> None:
    """Raise for a PEFT layer that tensor parallel cannot place (an adapted embedding or convolution)."""
    if isinstance(getattr(module, "base_layer", None), nn.Module):
        base = type(module.get_submodule("base_layer")).__name__
        raise ConfigError(
            f"lora.target_modules adapts a layer of type {base} that tensor parallel splits, but the fsdp: engine "
            "places adapters under t on nn.Linear layers only; leave that layer out of target_modules or use t1"
        )


def _colwise_placement(name: str) -> Placement:
    # Base weight and bias split on out; lora_B [out, r] splits the same way, so (x A^T) B^T is this rank's
    # output columns; lora_A is used whole on the replicated input.
    return Shard(0) if name.startswith(("base_layer.", "lora_B.")) else Replicate()


def _rowwise_placement(name: str) -> Placement:
    # Base weight and lora_A [r, in] split on in: both products are partial sums, reduced together with the
    # layer's output; lora_B and the base bias are replicated (as RowwiseParallel replicates the bias).
    split = name == "base_layer.weight" or (name.startswith("lora_A.") and name.endswith(".weight"))
    return Shard(1) if split else Replicate()


def _distribute_peft_layer(
    style: ColwiseParallel | RowwiseParallel,
    module: nn.Module,
    mesh: DeviceMesh,
    placement_of: Callable[[str], Placement],
) -> nn.Module:
    """The PEFT layer with every parameter a DTensor placed by ``placement_of`` (its name in the layer), and
    ``style``'s input and output layouts at the layer's boundary."""

    def partition(name: str, submodule: nn.Module, device_mesh: DeviceMesh) -> None:
        if name:  # the layer's root places every parameter below it
            return
        for pname, param in list(submodule.named_parameters()):
            owner_name, _, leaf = pname.rpartition(".")
            owner = submodule.get_submodule(owner_name)
            tensor = distribute_tensor(param, device_mesh, [placement_of(pname)], src_data_rank=style.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(tensor, requires_grad=param.requires_grad))

    return distribute_module(
        module,
        mesh,
        partition,
        # (torch annotates the hooks as returning None; their return values replace the inputs and outputs)
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),  # pyright: ignore[reportArgumentType]
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class PeftColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` that also takes a PEFT LoRA layer: base and ``lora_B`` split on out, ``lora_A`` whole."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_peft_linear(module):
            check_not_peft(module)
            return super()._apply(module, device_mesh)
        return _distribute_peft_layer(self, module, device_mesh, _colwise_placement)


class PeftRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` that also takes a PEFT LoRA layer: base and ``lora_A`` split on in, ``lora_B`` replicated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_peft_linear(module):
            check_not_peft(module)
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # what RowwiseParallel asks of a linear's input
        return _distribute_peft_layer(self, module, device_mesh, _rowwise_placement)


def with_peft_placements(style: ParallelStyle) -> ParallelStyle:
    """``style`` that also places PEFT LoRA layers by their base layer's split (column- and row-wise styles only)."""
    for base, peft in ((ColwiseParallel, PeftColwiseParallel), (RowwiseParallel, PeftRowwiseParallel)):
        if type(style) is base:
            # Same settings (layouts, local output, source rank); PEFT layers are placed whole.
            out = peft()
            vars(out).update(vars(style))
            return out
    return style
