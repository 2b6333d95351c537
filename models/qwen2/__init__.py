"""Qwen2 dense models (``model_type = "qwen2"``): qkv bias, no q/k norm."""

from models.qwen2 import spec  # noqa: F401  (registers the spec)
from models.qwen2.model.args import Qwen2ModelArgs
from models.qwen2.model.model import Qwen2Model
from models.qwen2.model.state_dict_adapter import Qwen2StateDictAdapter

__all__ = ["Qwen2Model", "Qwen2ModelArgs", "Qwen2StateDictAdapter"]
