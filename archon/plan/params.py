"""The model's shape as the memory planner sees it: config.json, the Archon model args, and every parameter (and
LoRA adapter) by FSDP unit and tensor-parallel kind, counted on a meta-device model.

torch and the model code are imported inside the functions that build a model: ``python -m archon.plan`` and the
config checks import this module and stay free of torch's import time until a model is counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archon.errors import ArchonError

_TP_LINEARS = ("wq", "wk", "wv", "w1", "w2", "w3")


class MemoryEstimateError(ArchonError, ValueError):
    """The estimate cannot be made (no config.json to read, a model type Archon does not know)."""


def read_model_config(cfg_or_path: Any) -> dict[str, Any]:
    """config.json of ``actor.path`` (when it is a local folder) or ``actor.model_config``, as a dict."""
    if isinstance(cfg_or_path, (str, Path)):
        sources = [str(cfg_or_path)]
    else:
        sources = [cfg_or_path.path, cfg_or_path.model_config]
    for source in filter(None, sources):
        p = Path(source)
        file = p if p.name == "config.json" else p / "config.json"
        if file.is_file():
            return json.loads(file.read_text())
    raise MemoryEstimateError(
        f"no config.json at actor.path = '{sources[0]}'"
        + (f" or actor.model_config = '{sources[1]}'" if len(sources) > 1 else "")
        + "; the memory estimate reads the model's architecture from it: set actor.model_config to a folder "
        "(or config.json) of the same model, e.g. the ones in configs/models/"
    )


def model_args_of(hf: dict[str, Any], is_critic: bool = False):
    """The Archon model args (a ``DecoderArgs``) of a config.json dict."""
    import models  # noqa: F401  (registers the built-in model specs; imported here, see the module doc)
    from models import get_model_spec

    spec = get_model_spec(hf.get("model_type", ""))
    return spec, spec.model_args_class.from_hf_config(hf, is_critic=is_critic)


@dataclass(frozen=True)
class ParamGroup:
    """Parameters of one module of the model that FSDP treats as one unit."""

    unit: str
    """'tok_embeddings', 'layers.<i>', 'layers.<i>.experts' or 'head' (norm + output)."""
    numel: int
    """Elements of the full parameters."""
    kind: str
    """'tp' (split by tensor parallel), 'replicated' (whole on every TP rank) or 'expert'."""


def param_groups(spec: Any, args: Any) -> list[ParamGroup]:
    """Every parameter of the model by FSDP unit and sharding kind, from a meta-device model."""
    import torch

    with torch.device("meta"):
        model = spec.model_class(args)
    groups: dict[tuple[str, str], int] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        parts = name.split(".")
        if parts[0] == "layers":
            unit = f"layers.{parts[1]}" + (".experts" if ".experts." in name else "")
        else:
            unit = "tok_embeddings" if parts[0] == "tok_embeddings" else "head"
        if ".experts." in name:
            kind = "expert"
        elif parts[0] == "tok_embeddings" or (parts[0] == "output" and not args.is_critic):
            kind = "tp"
        elif len(parts) >= 2 and (parts[-2] in _TP_LINEARS or (parts[-2] == "wo" and parts[-1] == "weight")):
            kind = "tp"
        else:
            kind = "replicated"
        groups[(unit, kind)] = groups.get((unit, kind), 0) + p.numel()
    return [ParamGroup(u, n, k) for (u, k), n in groups.items()]


def lora_param_groups(spec: Any, args: Any, lora: Any) -> list[ParamGroup]:
    """The LoRA adapters' parameters (``lora`` is a ``LoRAConfig``) by FSDP unit, counted as replicated over TP
    (half of each adapter is split like its base layer: a small over-estimate)."""
    import torch

    from models.lora import lora_targets

    with torch.device("meta"):
        model = spec.model_class(args)
    groups: dict[str, int] = {}
    for name in lora_targets(model, spec.state_dict_adapter_class(args), list(lora.target_modules)):
        layer = model.get_submodule(name)
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "head"
        groups[unit] = groups.get(unit, 0) + lora.rank * (layer.in_features + layer.out_features)
    return [ParamGroup(u, n, "replicated") for u, n in groups.items()]
