"""LoRA on the fsdp: engine through the real ``peft``: only adapters train (no optimizer state for the base),
and the merged export is the model the engine computes with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
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
