"""Splitting a decoder into pipeline stages by module names.

A decoder in the torchtitan layout has top-level modules that run once (``tok_embeddings``
before the blocks, ``norm`` and ``output`` after them) and a ``layers`` ModuleDict of blocks
keyed "0".."n-1".  A stage is named by the modules it keeps::

    4 layers, 2 stages:  stage 0 = tok_embeddings, layers.0, layers.1
                         stage 1 = layers.2, layers.3, norm, output

Every stage is a copy of the whole (meta-device) model with the other blocks deleted and the
other top-level modules set to None, so parameter names stay those of the full model on
every stage: checkpoints, HF loading and weight export need no renaming.
"""

from __future__ import annotations

import copy
from typing import cast

import torch.nn as nn

FIRST_STAGE_MODULES = ("tok_embeddings",)
LAST_STAGE_MODULES = ("norm", "output")


class PipelineConfigError(ValueError):
    """A pipeline-parallel setting that cannot work (schedule, stage count, AC mode, tied weights)."""


def count_stages(n_layers: int, pp: int, stages_per_rank: int | None, layers_per_stage: int = 0) -> int:
    """Number of pipeline stages for ``n_layers`` blocks over ``pp`` ranks.

    ``layers_per_stage`` (when > 0) fixes the stage size; otherwise every rank gets
    ``stages_per_rank`` stages.  ``stages_per_rank`` None means the schedule accepts any
    count per rank.  Raises ``PipelineConfigError`` when the layers do not split evenly.
    """
    if layers_per_stage < 0:
        raise PipelineConfigError(
            f"archon.pp_layers_per_stage = {layers_per_stage} must be 0 (derive it) or a "
            "positive number of transformer blocks"
        )
    if layers_per_stage:
        if n_layers % layers_per_stage:
            raise PipelineConfigError(
                f"the model's {n_layers} layers do not split into stages of "
                f"archon.pp_layers_per_stage = {layers_per_stage}; choose a divisor of "
                f"{n_layers}"
            )
        n_stages = n_layers // layers_per_stage
        if n_stages % pp:
            raise PipelineConfigError(
                f"archon.pp_layers_per_stage = {layers_per_stage} makes {n_stages} stages of "
                f"{n_layers} layers, which p{pp} ranks cannot share equally; choose it so "
                f"that {n_layers} / pp_layers_per_stage is a multiple of {pp}"
            )
        if stages_per_rank is not None and n_stages != stages_per_rank * pp:
            raise PipelineConfigError(
                f"archon.pp_layers_per_stage = {layers_per_stage} makes {n_stages // pp} "
                f"stage(s) per rank over p{pp}, but the schedule needs exactly "
                f"{stages_per_rank}; set pp_layers_per_stage = "
                f"{max(1, n_layers // (stages_per_rank * pp))} or pick another "
                "archon.pp_schedule"
            )
        return n_stages
    n_stages = pp * (stages_per_rank or 2)
    if n_layers % n_stages:
        raise PipelineConfigError(
            f"the model's {n_layers} layers do not split evenly into {n_stages} pipeline "
            f"stages (p{pp} x {n_stages // pp} per rank); set archon.pp_layers_per_stage to a "
            f"divisor of {n_layers} or change p"
        )
    return n_stages


def stage_module_names(n_layers: int, n_stages: int) -> list[list[str]]:
    """Module names held by each stage: consecutive equal blocks; embeddings first, norm and head last."""
    if n_stages < 1 or n_layers % n_stages:
        raise PipelineConfigError(f"{n_layers} layers do not split evenly into {n_stages} stages")
    per_stage = n_layers // n_stages
    stages = []
    for s in range(n_stages):
        names = [f"layers.{i}" for i in range(s * per_stage, (s + 1) * per_stage)]
        if s == 0:
            names = list(FIRST_STAGE_MODULES) + names
        if s == n_stages - 1:
            names = names + list(LAST_STAGE_MODULES)
        stages.append(names)
    return stages


def build_stage_module(model: nn.Module, module_names: list[str]) -> nn.Module:
    """A copy of ``model`` that keeps only ``module_names`` (blocks as ``layers.<i>``, top-level modules by name).

    Parameter-free top-level modules (RoPE tables) stay on every stage.  ``model`` is meant
    to be on the meta device, where copying costs nothing.
    """
    keep = set(module_names)
    stage = copy.deepcopy(model)
    for name, child in list(stage.named_children()):
        if name == "layers":
            layers = cast(nn.ModuleDict, child)
            for key in list(layers.keys()):
                if f"layers.{key}" not in keep:
                    del layers[key]
        elif name not in keep and any(True for _ in child.parameters()):
            setattr(stage, name, None)
    return stage


def owner_stage(param_name: str, stages: list[list[str]]) -> int:
    """Index of the stage holding parameter ``param_name`` (a name of the full model)."""
    for s, names in enumerate(stages):
        for module in names:
            if param_name == module or param_name.startswith(module + "."):
                return s
    raise KeyError(f"parameter {param_name!r} belongs to no pipeline stage")
