"""FP8 training of linear layers with torchao (``torchao.float8``), applied before any other technique.

``convert_to_float8`` swaps a meta-device model's ``nn.Linear`` layers for torchao's ``Float8Linear``
(the same ``weight``/``bias`` parameters in high precision; inputs, weights and gradients are cast to
float8 with dynamic scales for each matmul), in the order torchtitan uses: float8 conversion first, then
tensor parallel, then FSDP2.  With float8 communication under the tensorwise recipe, TP uses torchao's
float8-aware column/row styles (``float8_tp_style``) and FSDP2 all-gathers the weights in float8
(``enable_fsdp_float8_all_gather``; their scales are precomputed after each optimizer step,
``precompute_float8_scales``); without it both communicate in high precision and the plain styles serve.

Layers left in high precision: the LM head (``output``), MoE router gates (``router``), linears whose
in/out features are not multiples of 16 (what the float8 matmul kernels take, torchao's own rule), and
the grouped MoE experts (parameters, not linears: torchao's grouped FP8 path is a CUDA-only prototype).

Without a GPU that has FP8 matmuls (CUDA SM 8.9+) the casts are real but the matmul is emulated
(``emulate=True``: dequantise, then a high-precision matmul), which runs the same conversion, sharding
and checkpoint code on CPU.  ``high_precision_linears`` runs a forward through the same layers
without the casts (what logprob recomputation uses unless it is asked to run in FP8).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from parallel.errors import ParallelConfigError

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes (``Float8LinearRecipeName``); torchao has no blockwise training recipe."""
SKIPPED_MODULES = ("output", "router")
"""Name parts of linears never converted: the LM head (or value head) and MoE router gates."""
FP8_DIM_MULTIPLE = 16
"""Float8 matmul kernels need in and out features that are multiples of 16."""
FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability with FP8 matmuls (Ada, Hopper and later)."""


_FLOAT8_LINEAR_MODULE = "torchao.float8.float8_linear"


def import_torchao(submodule: str = "") -> ModuleType:
    """``torchao.float8`` (or a submodule of it), imported on first use: torchao is the optional ``fp8`` extra and
    takes seconds to import, so runs without fp8 never load it."""
    name = f"torchao.float8{'.' + submodule if submodule else ''}"
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ParallelConfigError("fp8 training needs torchao; pip install 'archon[fp8]' or turn fp8 off") from None


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (False without importing torchao when nothing loaded it)."""
    loaded = sys.modules.get(_FLOAT8_LINEAR_MODULE)
    return loaded is not None and isinstance(module, loaded.Float8Linear)


def check_recipe(recipe: str) -> None:
    """Raise when ``recipe`` is not one of torchao's float8 training recipes."""
    if recipe not in FLOAT8_RECIPES:
        raise ParallelConfigError(
            f"fp8 recipe '{recipe}' is not a torchao float8 training recipe; use one of {', '.join(FLOAT8_RECIPES)}"
        )


def resolve_emulate(device: torch.device, allow_emulate: bool) -> bool:
    """Whether float8 matmuls are emulated on ``device``: always on CPU; on CUDA without FP8 matmuls only
    when ``allow_emulate`` says so (never silently); on an FP8-capable GPU when ``allow_emulate`` asks."""
    if device.type != "cuda":
        return True
    if torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY:
        return allow_emulate
    if not allow_emulate:
        raise ParallelConfigError(
            f"fp8 training needs FP8 matmuls (CUDA compute capability 8.9+), but {torch.cuda.get_device_name(device)} "
            "has fewer; turn fp8 off or set fp8_emulate = true to emulate it (slow, for testing only)"
        )
    return True


def fp8_shapes_ok(linear: nn.Linear) -> bool:
    """Whether the float8 kernels take ``linear``'s shape (in and out features multiples of 16)."""
    return linear.in_features % FP8_DIM_MULTIPLE == 0 and linear.out_features % FP8_DIM_MULTIPLE == 0


def float8_filter(skip: Sequence[str] = SKIPPED_MODULES):
    """``module_filter_fn`` for torchao: plain linears with FP8-ready shapes whose name has no part in ``skip``."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(part in skip for part in fqn.split(".")):
            return False
        return fp8_shapes_ok(module)

    return keep


def float8_config(recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` of ``recipe``; float8 all-gather under FSDP only where torchao has it
    (tensorwise)."""
    check_recipe(recipe)
    config = import_torchao().Float8LinearConfig.from_recipe_name(recipe)
    all_gather = fsdp_float8_all_gather and recipe == "tensorwise"
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def convert_to_float8(
    model: nn.Module,
    recipe: str,
    *,
    emulate: bool,
    fsdp_float8_all_gather: bool = False,
    float8_tp: bool = False,
    skip: Sequence[str] = SKIPPED_MODULES,
) -> list[str]:
    """Swap ``model``'s eligible linears for ``Float8Linear`` in place (before TP and FSDP); returns their names.

    Float8 communication (tensorwise only, torchao has it for no other recipe): ``fsdp_float8_all_gather``
    makes FSDP all-gather these weights in float8, ``float8_tp`` makes TP cast their inputs to float8 before
    its collectives.  Every forward then runs through the casts; without them the communication is in high
    precision and ``high_precision_linears`` works.
    """
    config = float8_config(recipe, emulate=emulate, fsdp_float8_all_gather=fsdp_float8_all_gather)
    import_torchao().convert_to_float8_training(model, module_filter_fn=float8_filter(skip), config=config)
    names = float8_linear_names(model)
    for name in names:
        # Read by float8_tp_style when the model's TP plan is applied.
        cast(Any, model.get_submodule(name)).float8_tp = float8_tp and recipe == "tensorwise"
    return names


def _config(module: nn.Module) -> Any:
    """A float8 linear's ``Float8LinearConfig``."""
    return cast(Any, module).config


def float8_linear_names(model: nn.Module) -> list[str]:
    """Names of ``model``'s float8 linears."""
    return [name for name, module in model.named_modules() if is_float8_linear(module)]


def is_tensorwise(module: nn.Module) -> bool:
    """Whether ``module`` is a float8 linear with tensorwise scaling (what torchao's float8 TP styles assume)."""
    if not is_float8_linear(module):
        return False
    granularity = _config(module).cast_config_input.scaling_granularity
    return granularity is import_torchao("config").ScalingGranularity.TENSORWISE


def float8_tp_style(style: ParallelStyle, module: nn.Module) -> ParallelStyle:
    """``style`` for ``module``: torchao's float8 column/row styles (inputs cast to float8 before the
    collective) on a tensorwise float8 linear converted with ``float8_tp``; the plain styles
    suit the other float8 linears (DTensor inputs, global amax) and every other module."""
    if not (getattr(module, "float8_tp", False) and is_tensorwise(module)):
        return style
    tp = import_torchao("float8_tensor_parallel")
    for base, float8 in ((ColwiseParallel, tp.Float8ColwiseParallel), (RowwiseParallel, tp.Float8RowwiseParallel)):
        if type(style) is base:
            # Same layouts and local-output setting; only the input/output hooks cast.
            out = float8()
            vars(out).update(vars(style))
            return out
    return style


def uses_float8_all_gather(model: nn.Module) -> bool:
    """Whether any float8 linear of ``model`` all-gathers its weight in float8 under FSDP."""
    return any(is_float8_linear(m) and _config(m).enable_fsdp_float8_all_gather for m in model.modules())


def precompute_float8_scales(model: nn.Module) -> None:
    """At initialization, after a load and after every optimizer step: the float8 weights' scales for the next FSDP
    all-gather, each over the whole weight (one all-reduce over every mesh dimension).

    Does nothing for a model without float8 all-gather.
    """
    if uses_float8_all_gather(model):
        import_torchao().precompute_float8_dynamic_scale_for_fsdp(model)


def _plain_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


@contextmanager
def high_precision_linears(model: nn.Module) -> Iterator[None]:
    """Inside, every float8 linear of ``model`` computes ``F.linear`` in the parameters' dtype (no float8 casts).

    Linears converted with float8 communication get float8 weights from FSDP and float8 inputs from the TP
    hooks, so they cannot run this way: it raises.
    """
    linears = [m for m in model.modules() if is_float8_linear(m)]
    if any(getattr(m, "float8_tp", False) or _config(m).enable_fsdp_float8_all_gather for m in linears):
        raise ParallelConfigError(
            "float8 linears converted with float8 communication get float8 weights and inputs, so their "
            "forward cannot run in high precision; convert them without it"
        )
    saved: list[tuple[nn.Module, Any]] = []
    for m in linears:
        saved.append((m, m.__dict__.get("forward")))
        m.forward = _plain_forward.__get__(m)  # pyright: ignore[reportAttributeAccessIssue]
    try:
        yield
    finally:
        for m, previous in saved:
            if previous is None:
                del m.forward
            else:
                m.forward = previous
