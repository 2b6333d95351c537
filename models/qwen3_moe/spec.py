"""Registers the Qwen3-MoE model spec."""

from models.qwen3_moe.infra.parallelize import parallelize_qwen3_moe
from models.qwen3_moe.model.args import Qwen3MoeModelArgs
from models.qwen3_moe.model.model import Qwen3MoeModel
from models.qwen3_moe.model.state_dict_adapter import Qwen3MoeStateDictAdapter
from models.registry import ModelSpec, register_model_spec
from pipeline import pipeline_decoder

register_model_spec(
    ModelSpec(
        name="qwen3_moe",
        model_class=Qwen3MoeModel,
        model_args_class=Qwen3MoeModelArgs,
        state_dict_adapter_class=Qwen3MoeStateDictAdapter,
        parallelize_fn=parallelize_qwen3_moe,
        pipelining_fn=pipeline_decoder,
        supported_model_types=frozenset({"qwen3_moe"}),
    )
)
