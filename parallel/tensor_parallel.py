"""Tensor parallel building blocks on top of ``torch.distributed.tensor.parallel``.

A model's parallelize function writes its plan (which module gets which style); the styles
torch does not ship live here:

* ``ReplicateParallel``: parameters replicated over the TP mesh, input brought to a layout,
  output handed back local.  For small modules that should not be split (a MoE router, a
  critic's 1-wide value head) but must hold DTensor parameters like their neighbours, so
  that FSDP, the optimizer and gradient clipping see one kind of parameter, and so that a
  parameter used on different tokens per rank gets its gradient summed over TP.
* ``LocalTokensParallel``: a module that computes on this rank's sequence shard of its
  first input (a MoE layer under expert parallel); its other inputs are token-aligned and
  given for the whole sequence (a padding mask, replayed expert choices), so they are cut
  to the same shard.
* ``ExpertTensorParallel``: grouped experts ``w1, w3: [E, hidden, dim]`` split on ``hidden``
  and ``w2: [E, dim, hidden]`` on ``hidden`` too; each rank's output is a partial sum.

Modules that compute on local tensors must say where gradients are partial: a rank that
holds a slice of an expert's hidden dim produces only its share of the gradient of the
(replicated) tokens it was given, and a router whose scores weight partial expert outputs
gets a partial gradient too.  ``to_local(grad_placements=(Partial(),))`` marks exactly those
points, so the gradient is summed over TP once, where it becomes replicated again.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from parallel.errors import ParallelConfigError
from parallel.float8 import float8_tp_style

_REPLICATE = Replicate()


def _to_layout(x: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None) -> Any:
    if layout is None or not hasattr(x, "shape"):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    if desired is not None and x.placements != (desired,):
        x = x.redistribute(placements=(desired,), async_op=True)
    return x


class ReplicateParallel(ParallelStyle):
    """Replicate every parameter over the TP mesh; the first input goes ``input_layout -> desired``."""

    def __init__(
        self,
        *,
        input_layout: Placement | None = _REPLICATE,
        desired_input_layout: Placement | None = None,
        output_layout: Placement | None = None,
        use_local_output: bool = True,
        partial_output_grad: bool = False,
    ):
        super().__init__()
        self.input_layout = input_layout
        self.desired_input_layout = desired_input_layout or input_layout
        self.output_layout = output_layout
        self.use_local_output = use_local_output
        # Set when the local output feeds a computation whose gradient differs per TP rank
        # (e.g. a MoE router whose scores weight partial expert outputs).
        self.partial_output_grad = partial_output_grad

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if not inputs:
            return inputs
        first = _to_layout(inputs[0], mesh, self.input_layout, self.desired_input_layout)
        return (first, *inputs[1:])

    def _prepare_output(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        if isinstance(output, DTensor):
            if self.output_layout is not None and output.placements != (self.output_layout,):
                output = output.redistribute(placements=(self.output_layout,), async_op=True)
            if not self.use_local_output:
                return output
            return output.to_local(grad_placements=(Partial(),) if self.partial_output_grad else None)
        return output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(
                    pname,
                    nn.Parameter(distribute_tensor(param, mesh, [Replicate()]), requires_grad=param.requires_grad),
                )

        return distribute_module(
            module,
            device_mesh,
            partition,
            # (torch annotates input_fn as returning None; its return value replaces the inputs)
            input_fn=lambda mod, inputs, mesh: self._prepare_input(mod, inputs, mesh),  # pyright: ignore[reportArgumentType]
            output_fn=lambda mod, output, mesh: self._prepare_output(mod, output, mesh),
        )


class LocalTokensParallel(ParallelStyle):
    """The first input as this rank's local sequence shard; the other tensor inputs cut to it along ``seq_dim``.

    The first input must already be sharded on the sequence (a DTensor from a
    sequence-parallel norm, or its local shard).
    """

    def __init__(self, seq_dim: int = 1):
        super().__init__()
        self.seq_dim = seq_dim

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if not inputs:
            return inputs
        rank, size = mesh.get_local_rank(), mesh.size()
        x = inputs[0]
        if isinstance(x, DTensor):  # a sequence-parallel norm's Shard(seq) output
            x = x.to_local()
        rest = tuple(t.chunk(size, dim=self.seq_dim)[rank] if hasattr(t, "chunk") else t for t in inputs[1:])
        return (x, *rest)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # A hook only: distribute_module would also make every parameter below a TP DTensor.
        module.register_forward_pre_hook(lambda mod, inputs: self._prepare_input(mod, inputs, device_mesh))
        return module


class ExpertTensorParallel(ParallelStyle):
    """Split grouped experts over the hidden dim (w1/w3 dim 1, w2 dim 2); output is a partial sum.

    The module keeps its ``forward(x_sorted, num_tokens_per_expert)`` on local tensors (it
    calls ``to_local()`` on its weights), so the surrounding MoE module must bring tokens in
    replicated and reduce the output (see ``PrepareModuleInputOutput`` in the model's plan).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            dims = {"w1": 1, "w3": 1, "w2": 2}
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = Shard(dims[pname]) if pname in dims else Replicate()
                mod.register_parameter(
                    pname, nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad)
                )

        def input_fn(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            # Tokens arrive replicated; this rank's gradient for them covers its hidden slice only.
            x = DTensor.from_local(inputs[0], mesh, (Replicate(),), run_check=False)
            return (x.to_local(grad_placements=(Partial(),)), *inputs[1:])

        # (torch annotates input_fn as returning None; its return value replaces the inputs)
        return distribute_module(module, device_mesh, partition, input_fn=input_fn)  # pyright: ignore[reportArgumentType]


def _distribute_parameters(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: Any) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(pname, Replicate())
        module.register_parameter(
            pname,
            nn.Parameter(
                distribute_tensor(param, mesh, [placement], src_data_rank=src), requires_grad=param.requires_grad
            ),
        )


class LoRAColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` that also places a LoRA adapter: ``lora_b [out, r]`` split on ``out``, ``lora_a`` replicated.

    ``x A^T`` is then computed whole on every rank and ``(x A^T) B^T`` gives this rank's output columns, the
    same split as the base layer's.  On a layer without adapters it is ``ColwiseParallel``.
    """

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not hasattr(module, "lora_a"):
            return super()._partition_linear_fn(name, module, device_mesh)
        placements: dict[str, Placement] = {"weight": Shard(0), "bias": Shard(0), "lora_b": Shard(0)}
        _distribute_parameters(module, device_mesh, placements, self.src_data_rank)


class LoRARowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` that also places a LoRA adapter: ``lora_a [r, in]`` split on ``in``, ``lora_b`` replicated.

    Each rank's ``x_local A_local^T`` is a partial sum, and so is ``(.) B^T``: the adapter's output is
    reduced with the base layer's partial output.  On a layer without adapters it is ``RowwiseParallel``.
    """

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not hasattr(module, "lora_a"):
            return super()._partition_linear_fn(name, module, device_mesh)
        placements: dict[str, Placement] = {"weight": Shard(1), "lora_a": Shard(1)}
        _distribute_parameters(module, device_mesh, placements, self.src_data_rank)


def with_lora_placements(style: ParallelStyle) -> ParallelStyle:
    """``style`` with LoRA adapters placed by their base layer's split (column- and row-wise styles only)."""
    for base, lora in ((ColwiseParallel, LoRAColwiseParallel), (RowwiseParallel, LoRARowwiseParallel)):
        if type(style) is base:
            # Same settings (layouts, local output, source rank), one more rule for adapter parameters.
            out = lora()
            vars(out).update(vars(style))
            return out
    return style


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """``parallelize_module`` with a plan whose keys are module paths (wildcards allowed).

    Column- and row-wise styles also place the LoRA adapters of the layers they split (``LoRAColwiseParallel``,
    ``LoRARowwiseParallel``), so a model's plan needs no entries for adapters, and become torchao's float8
    styles on tensorwise float8 linears (``parallel.float8.float8_tp_style``).  Frozen parameters stay frozen.
    """
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    plan = {key: _with_float8(model, key, with_lora_placements(style)) for key, style in plan.items()}
    model = parallelize_module(model, tp_mesh, plan)
    # Some of torch's styles (SequenceParallel) make every parameter they distribute trainable: keep frozen ones
    # (a LoRA model's base) frozen.
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


def _with_float8(model: nn.Module, key: str, style: ParallelStyle) -> ParallelStyle:
    """``style`` for the module at ``key`` when it is a float8 linear (a wildcard key names no single module)."""
    if "*" in key:
        return style
    return float8_tp_style(style, model.get_submodule(key))


def check_divisible(sizes: dict[str, int], tp: int, model_name: str) -> None:
    """Raise a clear error when a head count or hidden size does not split over ``tp`` ranks."""
    for field_name, value in sizes.items():
        if value % tp:
            raise ParallelConfigError(
                f"{model_name}: {field_name}={value} is not divisible by the tensor-parallel size "
                f"t{tp}; choose t from the divisors of {value}"
            )
