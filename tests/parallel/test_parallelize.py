"""Parallelized models against the single-device model: every model type, head, AC mode and FSDP option.

Each case trains 3 steps with the engine and compares the per-step losses with ``archon:d1``
(same seed and data, float32): a wrong gradient anywhere (a replicated q/k norm under TP, a
router, tied embeddings, experts split over TP) changes the second and third losses.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import build_engine, critic_losses_and_values, engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf

STEPS = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, model_type, kw in [
        ("qwen2", "qwen2", {}),
        ("qwen3_tied", "qwen3", {"tie": True}),
        ("qwen3_moe", "qwen3_moe", {}),
    ]:
        folder = tmp_path_factory.mktemp(name)
        save_tiny_hf(folder, model_type, seed=5, **kw)
        out[name] = str(folder)
    return out


def _losses(path: str, backend: str, variants: list[dict]) -> list[list[float]] | None:
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    result = []
    for kw in variants:
        engine = ArchonEngine(engine_config(path, backend, **kw), total_steps=STEPS).initialize()
        stats = [engine.train_batch(make_batch(s), sft_loss, sft_weight) for s in range(STEPS)]
        # Losses and gradient norms: AdamW hides a gradient off by a constant factor from the losses.
        result.append([st["loss"] for st in stats] + [st["grad_norm"] for st in stats])
    return result if dist.get_rank() == 0 else None


def _assert_close(got: list[float], ref: list[float], what: str) -> None:
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4, f"{what}: {got} vs {ref}"


@pytest.mark.parametrize("model", ["qwen2", "qwen3_tied", "qwen3_moe"])
def test_model_types_under_tp_and_fsdp(folders, model):
    path = folders[model]
    ref = run_distributed(_losses, 1, path, "archon:d1", [{}])[0][0]
    for backend, world in [("archon:t2", 2), ("archon:d2t2", 4)]:
        got = run_distributed(_losses, world, path, backend, [{}])[0][0]
        _assert_close(got, ref, f"{model} {backend}")


def test_ac_modes_fsdp_options_and_hsdp(folders):
    path = folders["qwen3_moe"]
    ref = run_distributed(_losses, 1, path, "archon:d1", [{}])[0][0]
    variants = [
        {"gradient_checkpointing": True, "archon": {"ac_mode": "full"}},
        {"gradient_checkpointing": True, "archon": {"ac_mode": "selective", "selective_ac_option": "2"}},
        {
            "gradient_checkpointing": True,
            "archon": {"ac_mode": "selective", "selective_ac_option": "op", "ac_debug": True},
        },
        {"gradient_checkpointing": True, "archon": {"ac_mode": "full", "use_deterministic_algorithms": True}},
        {"archon": {"offload_params": True}},
        {"archon": {"dp_replicate": 2}},
    ]
    for got, kw in zip(run_distributed(_losses, 2, path, "archon:d2", variants)[0], variants):
        _assert_close(got, ref, f"d2 {kw}")
    hsdp = run_distributed(_losses, 4, path, "archon:d4", [{"archon": {"dp_replicate": 2}}])[0][0]
    _assert_close(hsdp, ref, "d4 with dp_replicate=2")


def test_memory_budget_needs_compile_and_heads_must_divide(folders):
    from dist_utils import DistributedTestError

    kw = {"gradient_checkpointing": True, "archon": {"ac_mode": "memory_budget"}}
    with pytest.raises(DistributedTestError, match="ac_mode = 'memory_budget' needs torch.compile"):
        run_distributed(build_engine, 1, folders["qwen2"], "archon:d1", kw)
    # The tiny models have 2 key/value heads: t4 cannot split them.
    with pytest.raises(
        DistributedTestError, match="num_key_value_heads=2 is not divisible by the tensor-parallel size t4"
    ):
        run_distributed(build_engine, 4, folders["qwen2"], "archon:t4", {})


def test_critic_head_under_tp_and_fsdp(folders):
    ref_losses, ref_norms, ref_values = run_distributed(
        critic_losses_and_values, 1, folders["qwen3_tied"], "archon:d1"
    )[0]
    got_losses, got_norms, got_values = run_distributed(
        critic_losses_and_values, 4, folders["qwen3_tied"], "archon:d2t2"
    )[0]
    _assert_close(got_losses, ref_losses, "critic d2t2")
    _assert_close(got_norms, ref_norms, "critic d2t2 grad norms")
    torch.testing.assert_close(got_values, ref_values, atol=1e-5, rtol=1e-5)
    assert torch.all(ref_values[:, 0] == 0)  # token-aligned: no value before the first token


def test_compile_matches_eager(folders):
    # Fixed shapes (pad_to_maximum under compile) keep this to one block graph (~25 s cold on CPU).
    kw = {"mb_spec": {"max_tokens_per_mb": 128}}
    eager = run_distributed(_losses, 1, folders["qwen2"], "archon:d1", [kw])[0][0]
    compiled = run_distributed(
        _losses, 1, folders["qwen2"], "archon:d1", [{**kw, "archon": {"enable_compile": True}}], timeout=600
    )[0][0]
    _assert_close(compiled, eager, "compile")
