"""Registers the Qwen2 model spec."""

from models.qwen2.infra.parallelize import parallelize_qwen2
from models.qwen2.model.args import Qwen2ModelArgs
from models.qwen2.model.model import Qwen2Model
from models.qwen2.model.state_dict_adapter import Qwen2StateDictAdapter
from models.registry import ModelSpec, register_model_spec
from pipeline import pipeline_decoder

register_model_spec(
    ModelSpec(
        name="qwen2",
        model_class=Qwen2Model,
        model_args_class=Qwen2ModelArgs,
        state_dict_adapter_class=Qwen2StateDictAdapter,
        parallelize_fn=parallelize_qwen2,
        pipelining_fn=pipeline_decoder,
        supported_model_types=frozenset({"qwen2"}),
    )
)
