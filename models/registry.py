"""The ``ModelSpec`` registry: which Archon model serves which Hugging Face ``model_type``."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from parallel.options import ParallelizeFn
from pipeline import PipeliningFn


class ModelRegistryError(ValueError):
    """A model type is unknown, or a spec clashes with one already registered."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything Archon needs to build, load, save and parallelize one model family."""

    name: str
    """Spec name, unique in the registry (``qwen3``)."""
    model_class: type[nn.Module]
    """Single-device ``nn.Module`` built as ``model_class(model_args)``."""
    model_args_class: type
    """``BaseModelArgs`` subclass with ``from_hf_config(hf_config, is_critic=False)``."""
    state_dict_adapter_class: type
    """``BaseStateDictAdapter`` subclass built as ``state_dict_adapter_class(model_args)``."""
    parallelize_fn: ParallelizeFn
    """``parallelize_fn(model, *, parallel_dims, options) -> model`` (``parallel.options.ParallelizeFn``)."""
    pipelining_fn: PipeliningFn | None
    """``pipelining_fn(model, *, parallel_dims, options, pipeline, parallelize_fn, device) -> PipelinedModel``
    (``pipeline.PipeliningFn``): this rank's parallelized pipeline stages of a meta-device model; None if the
    model cannot run with p > 1."""
    supported_model_types: frozenset[str]
    """Hugging Face ``model_type`` strings (config.json) this spec serves."""


_SPECS: dict[str, ModelSpec] = {}
_BY_MODEL_TYPE: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` to the registry; a duplicate name or model_type is an error."""
    if spec.name in _SPECS:
        raise ModelRegistryError(f"a model spec named {spec.name!r} is already registered; pick another name.")
    if not spec.supported_model_types:
        raise ModelRegistryError(f"model spec {spec.name!r} lists no supported_model_types.")
    taken = {t: _BY_MODEL_TYPE[t].name for t in spec.supported_model_types if t in _BY_MODEL_TYPE}
    if taken:
        raise ModelRegistryError(
            f"model spec {spec.name!r} claims model_type(s) already served by other specs: {taken}."
        )
    _SPECS[spec.name] = spec
    for model_type in spec.supported_model_types:
        _BY_MODEL_TYPE[model_type] = spec
    return spec


def unregister_model_spec(name: str) -> None:
    """Remove a spec (tests and interactive sessions that re-register a model)."""
    spec = _SPECS.pop(name)
    for model_type in spec.supported_model_types:
        _BY_MODEL_TYPE.pop(model_type, None)


def get_model_spec(model_type: str) -> ModelSpec:
    """The spec serving HF ``model_type``; the error lists the supported types."""
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise ModelRegistryError(
            f"model_type {model_type!r} has no Archon model spec (supported: {supported_model_types()}); generate "
            "one with `python scripts/add_model.py <checkpoint folder>` (it keeps the folder's config values; "
            f"`python scripts/add_model.py {model_type}` uses transformers' defaults), or train the transformers "
            "model as it is with an 'fsdp:' allocation (d, t, c)"
        ) from None


def supported_model_types() -> list[str]:
    """Sorted HF ``model_type`` strings with a registered spec."""
    return sorted(_BY_MODEL_TYPE)


def spec_for_model(model: nn.Module) -> ModelSpec:
    """The spec whose ``model_class`` built ``model``."""
    for spec in _SPECS.values():
        if type(model) is spec.model_class:
            return spec
    for spec in _SPECS.values():
        if isinstance(model, spec.model_class):
            return spec
    raise ModelRegistryError(
        f"no registered model spec builds {type(model).__name__}; pass a state-dict adapter explicitly."
    )


def spec_for_args(args: object) -> ModelSpec:
    """The spec whose ``model_args_class`` is the type of ``args``."""
    for spec in _SPECS.values():
        if type(args) is spec.model_args_class:
            return spec
    raise ModelRegistryError(f"no registered model spec uses {type(args).__name__}; register one first.")


MODELS_PATH_ENV = "ARCHON_MODELS_PATH"
"""Environment variable: extra folders (``os.pathsep``-separated) holding model packages."""


def import_model_packages(*folders: str | os.PathLike) -> list[str]:
    """Import (and so register) every model package: a folder with ``spec.py`` inside ``models/``, ``folders``
    or the folders of ``$ARCHON_MODELS_PATH``; they become ``models.<name>``.  Returns the package names."""
    # This module's own package, whose search path the extra folders join (``models/__init__`` calls this).
    models = sys.modules[__name__.rpartition(".")[0]]
    extra = [str(f) for f in folders] + [p for p in os.environ.get(MODELS_PATH_ENV, "").split(os.pathsep) if p]
    for folder in extra:
        folder = str(Path(folder).resolve())
        if folder not in models.__path__:
            models.__path__.append(folder)
    names = []
    for root in list(models.__path__):
        root_path = Path(root)
        if not root_path.is_dir():
            continue
        for child in sorted(root_path.iterdir()):
            if (child / "spec.py").is_file() and (child / "__init__.py").is_file():
                importlib.import_module(f"models.{child.name}")
                names.append(child.name)
    return names
