"""torchao float8 conversion of Archon's models (``parallel/float8.py``), single process, emulated on CPU.

Which linears convert (the LM head, MoE routers and shapes that are not multiples of 16 stay plain), and that
the emulated fp8 forward/backward of a tiny Qwen3 is close to the float32 one without being equal to it (the
casts really run), while ``high_precision_linears`` gives the float32 model's logits exactly.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from hf_fixtures import make_tiny_hf_config
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from models import get_model_spec
from parallel.errors import ParallelConfigError
from parallel.float8 import (
    convert_to_float8,
    float8_linear_names,
    float8_tp_style,
    high_precision_linears,
    is_float8_linear,
    resolve_emulate,
)

LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
FFN = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def _models(model_type: str, **overrides) -> tuple[Any, Any, list[str]]:
    """A float32 model with seeded weights and the same model converted to float8 on meta (tensorwise)."""
    config = make_tiny_hf_config(model_type, **overrides)
    spec = get_model_spec(model_type)
    args = spec.model_args_class.from_hf_config(config)
    torch.manual_seed(0)
    reference: Any = spec.model_class(args)
    reference.init_weights()
    with torch.device("meta"):
        converted: Any = spec.model_class(args)
    names = convert_to_float8(converted, "tensorwise", emulate=True)
    converted.to_empty(device="cpu")
    converted.init_weights()
    converted.load_state_dict(reference.state_dict())
    return reference, converted, names


def test_dense_converts_every_block_linear_but_not_the_head():
    _, model, names = _models("qwen3")
    assert names == [f"layers.{i}.{n}" for i in range(2) for n in LINEARS + FFN]
    assert not is_float8_linear(model.output)
    # The float8 linear keeps the high-precision parameter (what checkpoints and HF export read).
    assert model.layers["0"].attention.wq.weight.dtype == torch.float32


def test_shapes_not_multiple_of_16_stay_plain():
    # intermediate_size 72: w1/w3 are [72, 64] and w2 [64, 72]; attention stays convertible.
    _, _, names = _models("qwen3", intermediate_size=72)
    assert names == [f"layers.{i}.{n}" for i in range(2) for n in LINEARS]


def test_moe_router_and_grouped_experts_stay_plain():
    _, model, names = _models("qwen3_moe")
    assert names == [f"layers.{i}.{n}" for i in range(2) for n in LINEARS]
    assert not is_float8_linear(model.layers["0"].moe.router.gate)
    assert float8_linear_names(model) == names


def test_unknown_recipe_is_refused():
    with pytest.raises(ParallelConfigError, match="blockwise.*tensorwise, rowwise"):
        convert_to_float8(torch.nn.Linear(16, 16), "blockwise", emulate=True)


@pytest.mark.parametrize(
    "recipe,comm,expected", [("tensorwise", True, "Float8"), ("tensorwise", False, ""), ("rowwise", True, "")]
)
def test_float8_tp_styles_only_with_tensorwise_float8_communication(recipe, comm, expected):
    linear = torch.nn.Sequential(torch.nn.Linear(32, 32))
    convert_to_float8(linear, recipe, emulate=True, fsdp_float8_all_gather=comm, float8_tp=comm)
    row = float8_tp_style(RowwiseParallel(output_layouts=Shard(1)), linear[0])
    assert type(float8_tp_style(ColwiseParallel(), linear[0])).__name__ == f"{expected}ColwiseParallel"
    assert type(row).__name__ == f"{expected}RowwiseParallel"
    assert cast(Any, row).output_layouts == (Shard(1),)  # the plan's layouts are kept
    # A plain linear keeps the plain style.
    assert type(float8_tp_style(ColwiseParallel(), torch.nn.Linear(32, 32))) is ColwiseParallel
    if comm and recipe == "tensorwise":
        with pytest.raises(ParallelConfigError, match="cannot run in high precision"), high_precision_linears(linear):
            pass


def test_cpu_always_emulates():
    assert resolve_emulate(torch.device("cpu"), allow_emulate=False)


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(tokens)
    loss = F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_forward_backward_close_to_high_precision(dtype):
    reference, converted, _ = _models("qwen3")
    reference.to(dtype)
    converted.to(dtype)
    tokens = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(reference, tokens)
    fp8_loss, fp8_grads = _loss_and_grads(converted, tokens)
    # e4m3 keeps 3 mantissa bits (relative rounding up to 2^-4 per element); over a 2-layer model the errors
    # average out: measured 1.9e-4 (float32) and 1.2e-5 (bfloat16) relative; 1e-2 leaves room, a wrong scale
    # (off by any power of two) or a dropped layer moves the loss far more.
    assert abs(fp8_loss - ref_loss) / ref_loss < 1e-2, (fp8_loss, ref_loss)
    assert fp8_loss != ref_loss  # the float8 casts ran
    name = "layers.0.attention.wq.weight"
    cos = F.cosine_similarity(fp8_grads[name].flatten().float(), ref_grads[name].flatten().float(), dim=0)
    assert cos > 0.98, float(cos)  # measured 0.992 (e5m2 gradients: 2 mantissa bits)
    with torch.no_grad(), high_precision_linears(converted):
        assert torch.equal(converted(tokens), reference(tokens))
