"""LoRA adapters out of the archon: engine: an untrained adapter changes nothing, the PEFT adapter folder loads
with the real ``peft`` onto the transformers model with equal logits, the merged HF export too, and a checkpoint
resumes the adapters and their optimizer state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf

LORA: dict[str, Any] = {"enabled": True, "rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf(folder, "qwen3", seed=3)
    return str(folder)


def _config(path: str, backend: str, lora: dict[str, Any] | None):
    from archon.config.lora import LoRAConfig

    kw: dict[str, Any] = {} if lora is None else {"lora": LoRAConfig(**{**LORA, **lora})}
    return engine_config(path, backend, **kw)


def _forward(path: str, lora: dict[str, Any] | None) -> torch.Tensor:
    from archon.engine.engine import ArchonEngine

    engine = ArchonEngine(_config(path, "archon:d1", lora)).initialize()
    return engine.forward(make_batch(0))["logprobs"]


def test_untrained_adapter_leaves_the_model_unchanged(qwen3_path):
    base = run_distributed(_forward, 1, qwen3_path, None)[0]
    with_adapter = run_distributed(_forward, 1, qwen3_path, {})[0]
    torch.testing.assert_close(with_adapter, base, atol=0.0, rtol=0.0)
    # A non-zero B does change it (so the comparison above can fail).
    random_b = run_distributed(_forward, 1, qwen3_path, {"init_lora_weights": False})[0]
    assert (random_b - base).abs().max() > 1e-3


def _train_and_export(path: str, backend: str, out: str) -> torch.Tensor:
    from archon.engine.engine import ArchonEngine

    engine = ArchonEngine(_config(path, backend, {"target_modules": ["all-linear"]}), total_steps=3).initialize()
    for step in range(3):
        engine.train_batch(make_batch(step), sft_loss, sft_weight)
    engine.export_peft(Path(out) / "adapter")
    engine.export_hf(Path(out) / "merged")
    return engine.forward(make_batch(5))["logprobs"]


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities as the engine returns them: position t holds log p(ids[t] | ids[:t])."""
    out = torch.zeros(ids.shape)
    out[:, 1:] = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return out


def test_peft_round_trip_and_merged_export(qwen3_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ours = run_distributed(_train_and_export, 2, qwen3_path, "archon:t2", str(tmp_path))[0]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }

    batch = make_batch(5)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    base = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(ids, attention_mask=mask).logits
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        peft_logits = peft_model(ids, attention_mask=mask).logits
        merged_logits = merged(ids, attention_mask=mask).logits
    real = mask.bool()
    # The trained adapters moved the model, and peft applies them as the engine does.
    assert (peft_logits - base_logits)[real].abs().max() > 1e-2
    torch.testing.assert_close(peft_logits[real], merged_logits[real], atol=1e-4, rtol=1e-4)
    lp = _token_logprobs(peft_logits, ids)
    loss_tokens = real.clone()
    loss_tokens[:, 0] = False
    torch.testing.assert_close(ours[loss_tokens], lp[loss_tokens], atol=1e-4, rtol=1e-4)


def _resume(path: str, ckpt: str, phase: str, backend: str) -> list[float] | None:
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    engine = ArchonEngine(_config(path, backend, {"init_lora_weights": False}), total_steps=4).initialize()
    todo = range(4) if phase == "full" else range(2) if phase == "first" else range(2, 4)
    if phase == "second":
        engine.load(ckpt)
        assert engine.step == 2
    losses = [engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in todo]
    if phase == "first":
        engine.save(ckpt)
    return losses if dist.get_rank() == 0 else None


def test_checkpoint_resumes_adapters_and_their_optimizer_state(qwen3_path, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(_resume, 2, qwen3_path, ckpt, "full", "archon:d2")[0]
    first = run_distributed(_resume, 2, qwen3_path, ckpt, "first", "archon:d2")[0]
    second = run_distributed(_resume, 1, qwen3_path, ckpt, "second", "archon:d1")[0]
    resumed = first + second
    assert max(abs(a - b) for a, b in zip(full, resumed)) < 1e-5, (full, resumed)
