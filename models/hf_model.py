"""Single-device entry points: build a model, load it from / save it to a Hugging Face folder."""

from __future__ import annotations

import os
from typing import Any, Protocol, cast

import torch
import torch.nn as nn

from models.hf_checkpoint import HFCheckpointError, load_hf_weights, read_hf_config, save_hf_tensors
from models.model_args import BaseModelArgs, hf_config_to_dict
from models.registry import ModelSpec, get_model_spec, spec_for_args, spec_for_model
from parallel.fqn import clean_fqn


class _ModelInit(Protocol):
    """The initialisers a registered model class has besides ``nn.Module``'s (``Decoder``'s)."""

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None: ...

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None: ...


def _spec_and_args(args_or_hf_config: Any, is_critic: bool) -> tuple[ModelSpec, BaseModelArgs]:
    if isinstance(args_or_hf_config, BaseModelArgs):
        return spec_for_args(args_or_hf_config), args_or_hf_config
    cfg = hf_config_to_dict(args_or_hf_config)
    model_type = cfg.get("model_type")
    if not model_type:
        raise HFCheckpointError("the Hugging Face config has no model_type; Archon picks the model by it.")
    spec = get_model_spec(model_type)
    return spec, spec.model_args_class.from_hf_config(cfg, is_critic=is_critic)


def build_model(
    args_or_hf_config: Any,
    device: torch.device | str = "meta",
    dtype: torch.dtype | None = None,
    is_critic: bool = False,
) -> nn.Module:
    """Build a model from ``BaseModelArgs`` or an HF config (dict or transformers object).

    On ``device="meta"`` (default) nothing is allocated: parallelize, then ``to_empty`` and
    ``init_weights`` or load HF weights.  On a real device the model is initialised with
    ``init_weights`` (random, normal(0, initializer_range)).  ``is_critic`` applies to HF configs.
    """
    spec, args = _spec_and_args(args_or_hf_config, is_critic)
    with torch.device("meta"):
        model = spec.model_class(args)
    if dtype is not None:
        model.to(dtype=dtype)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        cast(_ModelInit, model).init_weights(buffer_device=device)
    return model


def load_hf_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    is_critic: bool = False,
) -> nn.Module:
    """Load a Hugging Face model folder (config.json + safetensors) into a single-device model.

    The model type is picked by ``config.json``'s ``model_type``.  Single-file and sharded
    (``model.safetensors.index.json``) checkpoints load; every parameter must be filled and
    every checkpoint tensor used.  With ``is_critic=True`` the LM head is replaced by a value
    head: loading a causal-LM checkpoint skips ``lm_head.weight`` and initialises the value
    head normal(0, initializer_range); a critic checkpoint (``score.weight``) fills it.
    """
    cfg = read_hf_config(path)
    model_type = cfg.get("model_type")
    if not model_type:
        raise HFCheckpointError(f"{os.fspath(path)}/config.json has no model_type; Archon picks the model by it.")
    spec = get_model_spec(model_type)
    args = spec.model_args_class.from_hf_config(cfg, is_critic=is_critic)
    with torch.device("meta"):
        model = spec.model_class(args)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    if is_critic or not hasattr(model, "init_buffers"):
        # The value head may not be in the checkpoint; everything else is overwritten.
        cast(_ModelInit, model).init_weights(buffer_device=device)
    else:
        cast(_ModelInit, model).init_buffers(buffer_device=device)
    load_hf_weights(model, path, spec.state_dict_adapter_class(args), strict=True)
    return model


def save_hf(
    model: nn.Module, path: str | os.PathLike, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None
) -> None:
    """Write ``model`` as a Hugging Face folder: ``config.json`` and sharded safetensors.

    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads it with equal logits
    (a critic saves as ``*ForTokenClassification`` with one label).  ``dtype`` casts the
    saved tensors (default: as in the model).
    """
    args = getattr(model, "args", None)
    if args is None:
        raise HFCheckpointError(f"{type(model).__name__} has no .args; save_hf needs them to write config.json.")
    adapter = spec_for_model(model).state_dict_adapter_class(args)
    cfg = args.to_hf_config()
    state_dict = model.state_dict()
    first = next((t for t in state_dict.values() if t.is_floating_point()), None)
    save_dtype = dtype if dtype is not None else (first.dtype if first is not None else torch.float32)
    cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] = str(save_dtype).removeprefix("torch.")

    def hf_tensors():
        for name, tensor in state_dict.items():
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            for hf_name, value in adapter.to_hf_tensors(clean_fqn(name), tensor):
                if adapter.is_hf_field(hf_name):
                    yield hf_name, value

    save_hf_tensors(hf_tensors(), cfg, path, max_shard_size=max_shard_size)
