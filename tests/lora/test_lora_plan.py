"""The memory planner under LoRA: the frozen base is counted in the training dtype without gradients or
optimizer state, the adapters with float32 master weights, gradients and AdamW's two moments."""

from __future__ import annotations

import json

import torch
from engine_utils import engine_config
from hf_fixtures import make_tiny_hf_config

from archon.config.lora import LoRAConfig
from archon.plan.memory import Workload, estimate_training_rank

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _terms(cfg, hf) -> dict[str, int]:
    estimate = estimate_training_rank(cfg, hf, Workload(4, 32), device_type="cpu")
    return {t.name: t.bytes for t in estimate.terms}


def test_lora_counts_frozen_base_and_adapter_state(tmp_path):
    from transformers import AutoModelForCausalLM

    config = make_tiny_hf_config("qwen3")
    config.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    # Hand count on transformers' own model: every targeted projection gets r * (in + out) adapter parameters.
    model = AutoModelForCausalLM.from_config(config)
    rank = 4
    adapters = sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    )
    total = sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once
    assert adapters > 0

    cfg = engine_config("", "archon:d1", mb_spec={"n_mbs": 2})
    cfg.dtype = "bfloat16"
    full = _terms(cfg, hf)
    cfg.lora = LoRAConfig(enabled=True, rank=rank)
    lora = _terms(cfg, hf)
    assert full["optimizer state (AdamW, float32)"] == 8 * total
    assert lora["optimizer state (AdamW, float32)"] == 8 * adapters
    assert lora["parameters (float32, sharded)"] == 4 * adapters
    assert lora["parameters (frozen base in bfloat16, sharded)"] == 2 * total
    assert lora["gradients (float32)"] == 4 * adapters
    assert sum(lora.values()) < sum(full.values())


def test_a_lora_actors_reference_is_not_counted_as_an_engine():
    from archon.config import load_config
    from archon.plan.fit import _engines

    base = ["actor.backend=archon:d1", "actor.path=m", "actor.kl_loss_coef=0.1"]
    names = lambda extra: [e[0] for e in _engines(load_config(None, base + extra, validate=False), "rl")]  # noqa: E731
    assert names([]) == ["actor", "ref"]
    assert names(["actor.lora.enabled=true"]) == ["actor"]  # the reference is the actor with adapters off
    assert names(["actor.lora.enabled=true", "ref.lora.enabled=false"]) == ["actor", "ref"]
