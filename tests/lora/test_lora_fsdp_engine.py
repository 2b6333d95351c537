"""LoRA on the fsdp: engine through the real ``peft``: only adapters train (no optimizer state for the base),
and the merged export is the model the engine computes with.  Under tensor parallel (t2, d2t2) the adapters follow
their base layer's split and a run matches the single-device one (``fsdp:d1``, same seed and data): losses, grad
norms, adapter gradients, adapters after the steps, merged weights and logprobs with adapters on and off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from engine_utils import engine_config, full_copy, make_batch, record_grads, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf(folder, "qwen3", seed=3)
    return str(folder)


def _train_and_export(path: str, out: str) -> dict[str, Any]:
    import torch.distributed as dist

    from archon.config.lora import LoRAConfig
    from archon.engine import build_engine

    cfg = engine_config(path, "fsdp:d2", lora=LoRAConfig(enabled=True, rank=4, alpha=8))
    engine = build_engine(cfg, total_steps=3).initialize()
    assert engine.model is not None and engine.optimizer is not None
    params = dict(engine.model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)
    losses = [engine.train_batch(make_batch(s % 2), sft_loss, sft_weight)["loss"] for s in range(3)]
    assert {id(p) for p in engine.optimizer.state} == {id(params[n]) for n in trainable}
    engine.export_hf(out)
    assert engine.export_peft(f"{out}_adapter")
    logprobs = engine.forward(make_batch(5))["logprobs"]
    return {"losses": losses, "logprobs": logprobs, "rank": dist.get_rank()}


def test_fsdp_engine_trains_peft_adapters_and_exports_merged_weights(qwen3_path, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    result = run_distributed(_train_and_export, 2, qwen3_path, str(out))[0]
    assert result["losses"][2] < result["losses"][0]  # batch 0 again, after two steps: the adapters learn
    source = {k: v for f in Path(qwen3_path).glob("*.safetensors") for k, v in load_file(str(f)).items()}
    merged = load_file(str(out / "model.safetensors"))
    # transformers' names, no PEFT names (the fsdp: engine writes a tied LM head out as well)
    assert set(source) <= set(merged) and not any("lora" in k or "base_layer" in k for k in merged)
    assert torch.equal(merged["model.embed_tokens.weight"], source["model.embed_tokens.weight"])  # frozen
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], source["model.layers.0.self_attn.q_proj.weight"]
    )

    batch = make_batch(5)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    lp = torch.zeros(ids.shape)
    lp[:, 1:] = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    real = mask.bool()
    real[:, 0] = False
    torch.testing.assert_close(result["logprobs"][real], lp[real], atol=1e-4, rtol=1e-4)
    # The PEFT folder: the real peft package puts it on the transformers base model, with the merged model's logits.
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "merged_adapter"))
    with torch.no_grad():
        peft_logits = adapted(ids, attention_mask=mask).logits
    torch.testing.assert_close(peft_logits[real], logits[real], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ tensor parallel
STEPS = 2


def _train_lora_tp(path: str, backend: str) -> dict[str, Any]:
    """Losses, every step's adapter gradients and the adapters after the steps (full tensors, by transformers/PEFT
    name), and the merged weights ``named_full_tensors`` sends to the servers; rank 0 returns them."""
    import torch.distributed as dist

    from archon.config.lora import LoRAConfig
    from archon.engine import build_engine
    from parallel.fqn import clean_fqn

    # B random (PEFT's init_lora_weights=False) so that A's gradient is not trivially zero.
    lora = LoRAConfig(enabled=True, rank=4, alpha=8, init_lora_weights=False)
    engine = build_engine(engine_config(path, backend, lora=lora), total_steps=STEPS).initialize()
    assert engine.model is not None and engine.optimizer is not None
    params = {clean_fqn(n): p for n, p in engine.model.named_parameters()}
    trainable = {n for n, p in params.items() if p.requires_grad}
    # The norms TP replicates with a summed gradient (q_norm, k_norm) stay frozen too.
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)
    if "t2" in backend:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        def tp_placement(name: str) -> Any:
            p = params[name]
            assert isinstance(p, DTensor), name
            return p.placements[-1]  # the TP dim (last; FSDP's dp_shard comes first under d2t2)

        # Adapters follow their base layer's split: column-parallel q_proj splits B's rows, row-parallel o_proj
        # A's columns.
        attn = "model.layers.0.self_attn"
        assert tp_placement(f"{attn}.q_proj.base_layer.weight") == Shard(0)
        assert tp_placement(f"{attn}.q_proj.lora_B.default.weight") == Shard(0)
        assert tp_placement(f"{attn}.q_proj.lora_A.default.weight") == Replicate()
        assert tp_placement(f"{attn}.o_proj.base_layer.weight") == Shard(1)
        assert tp_placement(f"{attn}.o_proj.lora_A.default.weight") == Shard(1)
        assert tp_placement(f"{attn}.o_proj.lora_B.default.weight") == Replicate()
    grads = record_grads(engine, params)
    stats = [engine.train_batch(make_batch(s), sft_loss, sft_weight) for s in range(STEPS)]
    adapters = {n: full_copy(params[n]) for n in trainable}
    merged = dict(engine.named_full_tensors())  # a collective: every rank drains it
    logprobs = engine.forward(make_batch(5))["logprobs"]
    with engine.adapters_off():  # the RL reference of a LoRA actor: PEFT's base layers alone
        base_logprobs = engine.forward(make_batch(5))["logprobs"]
    if dist.get_rank() != 0:
        return {}
    losses, norms = [st["loss"] for st in stats], [st["grad_norm"] for st in stats]
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "adapters": adapters,
        "merged": merged,
        "logprobs": logprobs,
        "base_logprobs": base_logprobs,
    }


@pytest.fixture(scope="module")
def tp_reference(qwen3_path) -> dict[str, Any]:
    return run_distributed(_train_lora_tp, 1, qwen3_path, "fsdp:d1")[0]


@pytest.mark.parametrize("backend,ranks", [("fsdp:t2", 2), pytest.param("fsdp:d2t2", 4, marks=pytest.mark.slow)])
def test_fsdp_lora_under_tensor_parallel_matches_single_device(qwen3_path, tp_reference, backend, ranks):
    got, ref = run_distributed(_train_lora_tp, ranks, qwen3_path, backend)[0], tp_reference
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < 1e-4, (got["losses"], ref["losses"])
    # The norm clipping reads (it clips: above max_grad_norm = 1) sums the replicated adapters' partial gradients.
    assert min(ref["norms"]) > 1.0, ref["norms"]
    torch.testing.assert_close(got["norms"], ref["norms"], atol=1e-4, rtol=1e-4)
    assert len(got["grads"]) == len(ref["grads"]) == STEPS
    for got_step, ref_step in zip(got["grads"], ref["grads"]):
        assert got_step.keys() == ref_step.keys() == ref["adapters"].keys()
        for name, g in ref_step.items():
            assert g.abs().max() > 0, name  # B random: both A's and B's gradients are non-trivial
            torch.testing.assert_close(got_step[name], g, atol=1e-4, rtol=1e-4, msg=name)
    assert got["adapters"].keys() == ref["adapters"].keys()
    for name, a in ref["adapters"].items():
        torch.testing.assert_close(got["adapters"][name], a, atol=1e-4, rtol=1e-4, msg=name)
    # Weight sync and the merged HF export: the same transformers-named full tensors as on one device.
    assert got["merged"].keys() == ref["merged"].keys()
    assert not any("lora" in k or "base_layer" in k for k in ref["merged"])
    for name, t in ref["merged"].items():
        torch.testing.assert_close(got["merged"][name], t, atol=1e-4, rtol=1e-4, msg=name)
    assert not torch.allclose(ref["logprobs"], ref["base_logprobs"], atol=1e-3)  # the adapters matter
    for key in ("logprobs", "base_logprobs"):
        torch.testing.assert_close(got[key], ref[key], atol=1e-4, rtol=1e-4, msg=key)
