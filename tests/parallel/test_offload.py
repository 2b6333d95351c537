"""``archon.offload_params``: parameters materialised where FSDP2's CPUOffloadPolicy wants them.

FSDP2 refuses to offload parameters that were materialised on the GPU ("FSDP parameters should
be materialized on CPU"), so under offload an engine must build them on the CPU while buffers
(RoPE tables, router statistics) go to the compute device, which FSDP never moves.  A CPU-only
machine cannot show the GPU side, so the device decision is a function checked for a CUDA
compute device, the buffer move is checked against another device (meta), and both engines
train with offload on CPU (CPUOffloadPolicy runs there) to the losses they reach without it.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf

from archon.config import ConfigError
from archon.engine.options import parameter_device
from archon.engine.transformers_model import build_meta_model, restore_buffers

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it


def test_offload_materialises_parameters_on_the_cpu():
    assert parameter_device(CUDA, cpu_offload=True, fsdp_enabled=True, where="actor") == torch.device("cpu")
    assert parameter_device(CUDA, cpu_offload=False, fsdp_enabled=True, where="actor") == CUDA
    assert parameter_device(CUDA, cpu_offload=False, fsdp_enabled=False, where="actor") == CUDA
    with pytest.raises(ConfigError, match=r"actor.backend = 'archon:t2': archon.offload_params = true offloads FSDP"):
        parameter_device(CUDA, cpu_offload=True, fsdp_enabled=False, where="actor.backend = 'archon:t2'")


def test_transformers_buffers_go_to_the_compute_device(tmp_path):
    from transformers import AutoConfig

    save_tiny_hf(tmp_path, "qwen3", seed=3)
    model, saved = build_meta_model(AutoConfig.from_pretrained(tmp_path), is_critic=False, attn_implementation=None)
    assert saved, "the tiny qwen3 has a RoPE buffer"
    model.to_empty(device="cpu")  # where offload puts the parameters
    # "meta" stands in for the GPU: a device other than the parameters'.
    restore_buffers(model, saved, torch.device("meta"))
    assert {b.device.type for b in model.buffers()} == {"meta"}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    # On the parameters' own device the saved values come back.
    model.to_empty(device="cpu")
    restore_buffers(model, saved, torch.device("cpu"))
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, saved[name], rtol=0, atol=0)


def _train(path: str, backend: str, offload: bool) -> tuple[list[float], set[str]] | None:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from archon.engine import build_engine

    engine = build_engine(engine_config(path, backend, archon={"offload_params": offload}), total_steps=3)
    engine.initialize()
    assert engine.model is not None
    groups = [m._get_fsdp_state()._fsdp_param_group for m in engine.model.modules() if isinstance(m, FSDPModule)]
    policies = {type(g.offload_policy) for g in groups if g is not None}
    assert (CPUOffloadPolicy in policies) == offload
    losses = [engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in range(3)]
    devices = {p.device.type for p in engine.model.parameters()}
    return (losses, devices) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("engine", ["archon", "fsdp"])
def test_offload_trains_like_no_offload(tmp_path, engine):
    save_tiny_hf(tmp_path, "qwen3", seed=3)
    backend = f"{engine}:d2"
    ref, _ = run_distributed(_train, 2, str(tmp_path), backend, False)[0]
    got, devices = run_distributed(_train, 2, str(tmp_path), backend, True)[0]
    assert devices == {"cpu"}
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5, (got, ref)


def test_offload_without_fsdp_is_refused(tmp_path):
    from dist_utils import DistributedTestError

    save_tiny_hf(tmp_path, "qwen3", seed=3)
    with pytest.raises(DistributedTestError, match=r"archon:d1'.*offload_params = true offloads FSDP-sharded"):
        run_distributed(_train, 1, str(tmp_path), "archon:d1", True)
