"""Qwen3 mixture-of-experts models (``model_type = "qwen3_moe"``)."""

from models.qwen3_moe import spec  # noqa: F401  (registers the spec)
from models.qwen3_moe.model.args import Qwen3MoeModelArgs
from models.qwen3_moe.model.model import Qwen3MoeModel
from models.qwen3_moe.model.state_dict_adapter import Qwen3MoeStateDictAdapter

__all__ = ["Qwen3MoeModel", "Qwen3MoeModelArgs", "Qwen3MoeStateDictAdapter"]
