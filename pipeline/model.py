"""A decoder split into pipeline stages: building this rank's stages, and what the engine asks of them.

``pipeline_decoder`` is the ``ModelSpec.pipelining_fn`` of decoders in the torchtitan layout
(``tok_embeddings``, ``layers``, ``norm``, ``output``).  It splits the meta-device model into
stages (``PipelineOptions``: schedule and layers per stage), keeps the ones placed on this
rank, parallelizes each with the model's own ``parallelize_fn`` (TP, AC, compile, FSDP per
stage, with the engine's ``ParallelizeOptions``) and returns a ``PipelinedModel``:

* ``parts``: this rank's stage modules in stage order (the engine materializes them);
* ``model``: the same modules seen as one model with the full model's parameter names (layers
  the rank does not hold are absent), for weight loading, the optimizer, checkpoints and
  export; it is never called;
* ``train_step`` / ``forward_step``: one pipelined step (see ``pipeline.runner``);
* ``named_full_tensors``: every parameter of the full model, in one order, on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from parallel.dims import ParallelDims
from parallel.dtypes import to_dtype
from parallel.options import ParallelizeFn, ParallelizeOptions
from pipeline.placement import rank_of_stage, stages_of_rank
from pipeline.runner import LossFn, Microbatch, OutputFn, PipelineRunner, StageBoundary
from pipeline.schedules import (
    ZERO_BUBBLE,
    check_activation_checkpointing,
    microbatch_count,
    placement_style,
    required_stages_per_rank,
)
from pipeline.split import PipelineConfigError, build_stage_module, count_stages, owner_stage, stage_module_names

logger = logging.getLogger("archon.pipeline")


@dataclass(frozen=True)
class PipelineOptions:
    """How a model is cut into pipeline stages and scheduled (the degree is ``ParallelDims.pp``)."""

    schedule: str
    """torch.distributed.pipelining schedule by name (see ``pipeline.schedules``); the engine's config has the
    default (``archon.pp_schedule``)."""
    layers_per_stage: int = 0
    """Transformer blocks per stage; 0 derives it from the layer count and the schedule."""


@dataclass(frozen=True)
class FullTensorInfo:
    """One parameter (or persistent buffer) of the full model and the pipeline rank that holds it."""

    name: str
    """Parameter or buffer name in the full (unsplit) model."""
    shape: torch.Size
    """Full (unsharded) shape."""
    dtype: torch.dtype
    """Parameter dtype."""
    owner: int
    """Pipeline rank (0..pp-1) whose stage holds it."""
    is_buffer: bool = False
    """A persistent buffer (the MoE routing bias) rather than a parameter."""


class PipelinedModel:
    """This rank's stages of one pipelined model."""

    def __init__(
        self, parts: list[nn.Module], model: nn.Module, runner: PipelineRunner, full_tensors: list[FullTensorInfo]
    ) -> None:
        self.parts = parts
        self.model = model
        self.runner = runner
        self.full_tensors = full_tensors
        self._warned_microbatches = False

    @property
    def n_stages(self) -> int:
        return self.runner.n_stages

    def microbatch_count(self, requested: int) -> int:
        """Microbatches per step for ``requested``: at least the stage count, and a count the schedule accepts."""
        n = microbatch_count(self.runner.schedule_name, requested, self.n_stages, self.runner.pp_size)
        if n > requested and requested < self.n_stages and not self._warned_microbatches:
            self._warned_microbatches = True
            if dist.get_rank() == 0:
                logger.warning(
                    "mb_spec.n_mbs = %d is below the %d pipeline stages, so every microbatch's "
                    "activations would pile up in warm-up; using %d microbatches (set mb_spec.n_mbs "
                    ">= %d to silence this)",
                    requested,
                    self.n_stages,
                    n,
                    self.n_stages,
                )
        return n

    def train_step(self, microbatches: list[Microbatch], loss_fn: LossFn) -> None:
        self.runner.train_step(microbatches, loss_fn)

    def forward_step(self, microbatches: list[Microbatch], output_fn: OutputFn) -> None:
        self.runner.forward_step(microbatches, output_fn)

    def broadcast_from_last_stage(self, obj: Any) -> Any:
        """``obj`` as the last stage's rank of this pipeline group has it (a collective over the group)."""
        box = [obj]
        dist.broadcast_object_list(
            box,
            src=self.runner.global_rank_of_stage(self.n_stages - 1),
            group=self.runner.pp_group,
            device=self.runner.device if self.runner.device.type != "cpu" else None,
        )
        return box[0]

    def named_full_tensors(self, local: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter (then persistent buffer) of the full model as a full tensor, in order, on every rank.

        ``local`` maps this rank's parameters and persistent buffers by full-model name.  Each tensor is gathered on the
        ranks of the stage holding it and broadcast over the pipeline group (a collective: every
        rank must iterate to the end).
        """
        group = self.runner.pp_group
        my_rank = dist.get_rank(group)
        for info in self.full_tensors:
            if info.owner == my_rank:
                tensor = local[info.name]
                # ``.to``: under CPU offload the parameters live on the CPU; every rank receives on the device.
                full = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
                full = full.to(self.runner.device).contiguous()
            else:
                full = torch.empty(info.shape, dtype=info.dtype, device=self.runner.device)
            dist.broadcast(full, src=dist.get_global_rank(group, info.owner), group=group)
            yield info.name, full


class PipeliningFn(Protocol):
    """``ModelSpec.pipelining_fn``: this rank's parallelized pipeline stages of a meta-device model."""

    def __call__(
        self,
        model: nn.Module,
        *,
        parallel_dims: ParallelDims,
        options: ParallelizeOptions,
        pipeline: PipelineOptions,
        parallelize_fn: ParallelizeFn,
        device: torch.device,
    ) -> PipelinedModel: ...


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for mod_name, mod in model.named_modules():
        for name, buf in mod.named_buffers(prefix=mod_name, recurse=False):
            if buf is not None and name.rsplit(".", 1)[-1] not in mod._non_persistent_buffers_set:
                out.append((name, buf))
    return out


def _activation_dtype(model: nn.Module, parallel_dims: ParallelDims, options: ParallelizeOptions) -> torch.dtype:
    # FSDP computes in its mixed-precision dtype; without FSDP the parameters' own dtype is used.
    if parallel_dims.fsdp_enabled:
        return to_dtype(options.param_dtype)
    return next(model.parameters()).dtype


def _rank_view(model: nn.Module, parts: list[nn.Module]) -> nn.Module:
    """``model`` emptied and refilled with the parts' modules, so names are the full model's."""
    layers = cast(nn.ModuleDict, model.layers)
    for key in list(layers.keys()):
        del layers[key]
    for part in parts:
        for key, block in cast(nn.ModuleDict, part.layers).items():
            layers[key] = block
    for name, child in list(model.named_children()):
        if name == "layers":
            continue
        if any(True for _ in child.parameters()):
            held = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            setattr(model, name, held[0] if held else None)
        else:
            # Parameter-free modules (RoPE tables) are shared, so every stage sees one buffer.
            for part in parts:
                setattr(part, name, child)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "this module is one pipeline rank's stages seen as a model (for loading, checkpoints "
            "and export); run it through PipelinedModel.train_step / forward_step"
        )

    model.forward = refuse
    return model


def pipeline_decoder(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    options: ParallelizeOptions,
    pipeline: PipelineOptions,
    parallelize_fn: ParallelizeFn,
    device: torch.device,
) -> PipelinedModel:
    """Split a meta-device decoder into pipeline stages and parallelize this rank's (see the module docstring).

    Raises ``PipelineConfigError`` for a layout that cannot work.
    """
    schedule = pipeline.schedule
    pp = parallel_dims.pp
    style = placement_style(schedule)
    if getattr(model, "embeddings_tied", False):
        raise PipelineConfigError(
            f"the model ties its input embeddings to its LM head (tie_word_embeddings = "
            f"true), which pipeline parallel (p{pp}) would put on different stages; use p1 "
            "(put those ranks in d or t) or a model without tied embeddings"
        )
    check_activation_checkpointing(schedule, options.ac_enabled, options.ac_mode, options.selective_ac_option)
    n_layers = len(cast(nn.ModuleDict, model.layers))
    n_stages = count_stages(n_layers, pp, required_stages_per_rank(schedule), pipeline.layers_per_stage)
    stage_modules = stage_module_names(n_layers, n_stages)
    pp_group = parallel_dims.get_mesh("pp").get_group()
    stage_ids = stages_of_rank(dist.get_rank(pp_group), pp, n_stages, style)
    if schedule in ZERO_BUBBLE and options.enable_compile:
        if dist.get_rank() == 0:
            logger.warning(
                "archon.pp_schedule = %r cannot run compiled stages (its split backward keeps graphs "
                "that compile's donated buffers would free); torch.compile is off for this engine",
                schedule,
            )
        options = options.without_compile()

    def owner(name: str) -> int:
        return rank_of_stage(owner_stage(name, stage_modules), pp, n_stages, style)

    full_tensors = [FullTensorInfo(name, p.shape, p.dtype, owner(name)) for name, p in model.named_parameters()]
    full_tensors += [
        FullTensorInfo(name, b.shape, b.dtype, owner(name), is_buffer=True) for name, b in _persistent_buffers(model)
    ]
    args: Any = model.args  # the decoder's args dataclass (defined in models/, above this layer)
    boundary = StageBoundary(
        hidden_dim=args.dim, dtype=_activation_dtype(model, parallel_dims, options), seq_shards=parallel_dims.tp
    )
    parts = [
        parallelize_fn(build_stage_module(model, stage_modules[sid]), parallel_dims=parallel_dims, options=options)
        for sid in stage_ids
    ]
    view = _rank_view(model, parts)
    runner = PipelineRunner(parts, stage_ids, n_stages, schedule, style, pp_group, device, boundary)
    if dist.get_rank() == 0:
        logger.info(
            "pipeline: %s over p%d, %d stages of %d layers (%s placement)",
            schedule,
            pp,
            n_stages,
            n_layers // n_stages,
            style,
        )
    return PipelinedModel(parts, view, runner, full_tensors)
