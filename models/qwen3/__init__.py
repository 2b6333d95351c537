"""Qwen3 dense models (``model_type = "qwen3"``): q/k RMSNorm, head_dim independent of hidden size."""

from models.qwen3 import spec  # noqa: F401  (registers the spec)
from models.qwen3.model.args import Qwen3ModelArgs
from models.qwen3.model.model import Qwen3Model
from models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "Qwen3StateDictAdapter"]
