"""torchao's low-bit AdamW (``optimizer.type = 'adamw_8bit' | 'adamw_fp8'``): the planner's byte count by hand,
and (slow: torchao compiles its step per tensor shape) an engine run whose real state has those bytes."""

from __future__ import annotations

import json

import pytest
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import make_tiny_hf_config, save_tiny_hf

from archon.plan.memory import Workload, estimate_training_rank
from archon.plan.optimizer_memory import adamw_state_bytes, moment_bytes


def test_moment_bytes_by_hand():
    # 8192 values = 32 blocks: 1 byte each + 32 float32 scales (+ the 8-bit code map, 256 float32).
    assert moment_bytes("adamw_8bit", 8192) == 8192 + 32 * 4 + 1024
    assert moment_bytes("adamw_fp8", 8192) == 8192 + 32 * 4
    # Under 4096 values, or not whole blocks: float32.
    assert moment_bytes("adamw_8bit", 2048) == 4 * 2048
    assert moment_bytes("adamw_fp8", 8200) == 4 * 8200
    assert moment_bytes("adamw", 8192) == 4 * 8192
    assert adamw_state_bytes("adamw_fp8", [8192, 64]) == 2 * (8192 + 128) + 2 * 256


@pytest.mark.parametrize("kind", ["adamw_8bit", "adamw_fp8"])
def test_planner_counts_low_bit_state(tmp_path, kind):
    make_tiny_hf_config("qwen3").save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    cfg = engine_config(str(tmp_path), "archon:d1", optimizer={"type": kind})
    terms = {t.name: t.bytes for t in estimate_training_rank(cfg, hf, Workload(4, 32), device_type="cpu").terms}
    qmap = 1024 if kind == "adamw_8bit" else 0
    # By FSDP unit of the tiny Qwen3 (hidden 64, vocab 128, 4 heads of 24, 2 kv heads, ffn 96): the embedding and
    # the LM head [128, 64] (8192 values, quantised); per layer the projections 64 * (96 + 48 + 48 + 96 + 3 * 96)
    # = 36864 values (quantised), its norms 64 + 64 + 24 + 24 = 176 (float32); the final norm 64 (float32).
    quantised = [8192, 8192, 36864, 36864]
    expected = sum(2 * (n + n // 256 * 4 + qmap) for n in quantised) + 2 * 4 * (176 + 176 + 64)
    label = "torchao AdamW8bit" if kind == "adamw_8bit" else "torchao AdamWFp8"
    assert terms[f"optimizer state ({label})"] == expected
    plain = engine_config(str(tmp_path), "archon:d1")
    full = {t.name: t.bytes for t in estimate_training_rank(plain, hf, Workload(4, 32), device_type="cpu").terms}
    assert full["optimizer state (AdamW, float32)"] > 3 * expected


def _train_low_bit(path: str, kind: str, backend: str, ckpt: str, phase: str) -> dict | None:
    """Four steps with ``kind`` on ``backend`` (``full``), or two then a checkpoint (``first``), or the checkpoint's
    last two (``second``); ``full`` also returns the state's real bytes and the planner rule's for the same tensors."""
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    cfg = engine_config(path, backend, optimizer={"type": kind})
    engine = ArchonEngine(cfg, total_steps=4).initialize()
    assert engine.optimizer is not None and type(engine.optimizer).__module__.startswith("torchao.optim")
    if phase == "second":
        engine.load(ckpt)
    todo = {"full": range(4), "first": range(2), "second": range(2, 4)}[phase]
    losses = [engine.train_batch(make_batch(s % 2), sft_loss, sft_weight)["loss"] for s in todo]
    if phase == "first":
        engine.save(ckpt)
    real = 0
    for state in engine.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            t = getattr(t, "_local_tensor", t)  # this rank's shard under FSDP
            inner = [getattr(t, a) for a in ("codes", "scale", "qmap") if hasattr(t, a)] or [t]
            real += sum(x.numel() * x.element_size() for x in inner)
    numels = [p.numel() for p in engine.model.parameters() if p.requires_grad]  # pyright: ignore[reportOptionalMemberAccess]
    out = {"losses": losses, "real": real, "rule": adamw_state_bytes(kind, numels)}
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow  # torchao compiles its step per tensor shape: ~25 s cold
@pytest.mark.parametrize("kind", ["adamw_8bit"])
def test_engine_trains_and_resumes_with_low_bit_adamw(tmp_path, kind):
    save_tiny_hf(tmp_path, "qwen3", seed=3)
    path, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    full = run_distributed(_train_low_bit, 1, path, kind, "archon:d1", ckpt, "full", timeout=600)[0]
    assert full["real"] == full["rule"]
    # The same two batches twice: the loss falls.
    assert full["losses"][2] < full["losses"][0] - 0.05, full["losses"]
    # A checkpoint holds the quantised moments (and the learning rate torchao keeps as a tensor): resuming it on
    # d2 (FSDP: each rank loads its shards) continues exactly where the uninterrupted run goes.
    first = run_distributed(_train_low_bit, 1, path, kind, "archon:d1", ckpt, "first", timeout=600)[0]
    second = run_distributed(_train_low_bit, 2, path, kind, "archon:d2", ckpt, "second", timeout=600)[0]
    assert first["losses"] + second["losses"] == pytest.approx(full["losses"], abs=1e-6)
