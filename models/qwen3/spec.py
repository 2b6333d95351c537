"""Registers the Qwen3 model spec."""

from models.qwen3.infra.parallelize import parallelize_qwen3
from models.qwen3.model.args import Qwen3ModelArgs
from models.qwen3.model.model import Qwen3Model
from models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter
from models.registry import ModelSpec, register_model_spec
from pipeline import pipeline_decoder

register_model_spec(
    ModelSpec(
        name="qwen3",
        model_class=Qwen3Model,
        model_args_class=Qwen3ModelArgs,
        state_dict_adapter_class=Qwen3StateDictAdapter,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_decoder,
        supported_model_types=frozenset({"qwen3"}),
    )
)
