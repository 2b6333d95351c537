"""`make run-lora` learns: GRPO with LoRA adapters re-targets the demo's last-letter model to the first letter.

The recipe's commands are read from the Makefile and run as they are in a scratch folder (its relative outputs/
paths land there), so the test runs what a user runs.  Every weight sync sends only the adapters, and the server,
which merges them, computes what the trainer computes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from make_recipes import recipe, run_recipe

pytestmark = pytest.mark.slow


def test_make_run_lora_learns_the_first_letter_with_adapter_sync(tmp_path: Path):
    commands = recipe("run-lora")
    assert any("train_sft.py" in c for c in commands) and any("cpu_demo_lora.toml" in c for c in commands)
    run_recipe("run-lora", tmp_path)
    out = tmp_path / "outputs" / "demo" / "lora"
    run = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(run) == 30
    start = sum(r["reward_mean"] for r in run[:3]) / 3
    end = sum(r["reward_mean"] for r in run[-5:]) / 5
    assert start < 0.1 and end > 0.7, (start, end)  # the base answers with the last letter: it learned the first
    model_bytes = (tmp_path / "outputs" / "demo" / "sft_last" / "hf" / "model.safetensors").stat().st_size
    for r in run:
        assert r["weight_sync_bytes"] < model_bytes / 2, r  # adapters, not the model, travelled
        assert r["behav_prox_logprob_diff"] < 1e-5 and r["weight_check/logprob_diff"] < 1e-5, r
    assert (out / "lora_adapter" / "adapter_model.safetensors").is_file() and (out / "hf").is_dir()
