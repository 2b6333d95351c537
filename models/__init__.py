"""Archon models: the ``ModelSpec`` registry, the built-in Qwen models, HF checkpoints in and out.

    import models
    model = models.load_hf_model("/path/to/Qwen3-0.6B")      # picks the spec by model_type
    logits = model(tokens)                                   # same function as transformers
    models.save_hf(model, "/path/to/out")                     # from_pretrained-loadable

Importing this package registers the built-in specs (qwen2, qwen3, qwen3_moe) and every other
model package found in ``models/`` or on ``$ARCHON_MODELS_PATH`` (``scripts/add_model.py`` writes them).
"""

from models.hf_checkpoint import (
    HFCheckpointError,
    HFLoadResult,
    adapter_for,
    load_hf_weights,
    read_hf_config,
    save_hf_tensors,
)
from models.hf_model import build_model, load_hf_model, save_hf
from models.model_args import BaseModelArgs, HFConfigError
from models.registry import (
    ModelRegistryError,
    ModelSpec,
    get_model_spec,
    import_model_packages,
    register_model_spec,
    spec_for_model,
    supported_model_types,
)
from models.state_dict_adapter import BaseStateDictAdapter, HFKeyTarget, UnknownKeyError

# Built-in models register themselves on import; so do packages added with scripts/add_model.py.
from models import qwen2, qwen3, qwen3_moe  # noqa: E402,F401  isort: skip

import_model_packages()

__all__ = [
    "BaseModelArgs",
    "BaseStateDictAdapter",
    "HFCheckpointError",
    "HFConfigError",
    "HFKeyTarget",
    "HFLoadResult",
    "ModelRegistryError",
    "ModelSpec",
    "UnknownKeyError",
    "adapter_for",
    "build_model",
    "get_model_spec",
    "import_model_packages",
    "load_hf_model",
    "load_hf_weights",
    "read_hf_config",
    "register_model_spec",
    "save_hf",
    "save_hf_tensors",
    "spec_for_model",
    "supported_model_types",
]
