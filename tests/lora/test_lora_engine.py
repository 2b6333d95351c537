"""LoRA on the archon: engine: adapters on a tiny Qwen3, laid over d2, t2, p2 and c2 (with activation checkpointing) as
over d1, and on a tiny Qwen3-MoE under expert parallel (adapters on attention; the grouped experts and the router
have none).

Every layout is compared with the single-device run (``archon:d1``) of the same seed and data: losses,
the adapters' gradients and the adapters after the steps agree within 1e-4 in float32.  Adapters start
with B random (PEFT's ``init_lora_weights = false``) so that A's gradient is not trivially zero.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import engine_config, full_copy, make_batch, record_grads, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf

STEPS = 2
LORA: dict[str, Any] = {"enabled": True, "rank": 4, "alpha": 8, "init_lora_weights": False}


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf(folder, "qwen3", seed=3)
    return str(folder)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3_moe")
    save_tiny_hf(folder, "qwen3_moe", seed=5)
    return str(folder)


def lora_config(path: str, backend: str, checkpointing: bool = False, **lora: Any):
    from archon.config.lora import LoRAConfig

    # One stage per rank under p2 (the tiny model has 2 layers).
    archon = {"pp_schedule": "1F1B"} if "p2" in backend else {}
    return engine_config(
        path, backend, lora=LoRAConfig(**{**LORA, **lora}), archon=archon, gradient_checkpointing=checkpointing
    )


def _train_lora(path: str, backend: str, checkpointing: bool = False) -> dict[str, Any]:
    """Losses, every step's adapter gradients (full, by name; this rank's stages) and the final adapters."""
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine
    from parallel.fqn import clean_fqn

    engine = ArchonEngine(lora_config(path, backend, checkpointing), total_steps=STEPS).initialize()
    assert engine.model is not None and engine.optimizer is not None
    params = {clean_fqn(n): p for n, p in engine.model.named_parameters()}
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_a", ".lora_b")) for n in trainable), sorted(trainable)
    if "t2" in backend:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        def placements(name: str) -> tuple:
            p = params[name]
            assert isinstance(p, DTensor), name
            return tuple(p.placements)

        # Adapters follow their base layer's split: column-parallel wq splits B's rows, row-parallel wo A's columns.
        assert placements("layers.0.attention.wq.lora_b") == (Shard(0),)
        assert placements("layers.0.attention.wq.lora_a") == (Replicate(),)
        assert placements("layers.0.attention.wo.lora_a") == (Shard(1),)
        assert placements("layers.0.attention.wo.lora_b") == (Replicate(),)
    base_before = {n: full_copy(p) for n, p in params.items() if n not in trainable}
    grads = record_grads(engine, params)
    losses = [engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in range(STEPS)]
    # Only adapters change, and only they have optimizer state (and are float32 master weights).
    for n, before in base_before.items():
        assert torch.equal(full_copy(params[n]), before), n
    state_ids = {id(p) for p in engine.optimizer.state}
    assert state_ids == {id(params[n]) for n in trainable}
    adapters = {n: full_copy(params[n]) for n in trainable}
    assert all(a.dtype == torch.float32 for a in adapters.values())
    out = {"losses": losses, "grads": grads, "adapters": adapters, "rank": dist.get_rank()}
    return out


def _merged(results: list[dict[str, Any]], key: str) -> Any:
    if key == "grads":
        steps = [dict() for _ in results[0]["grads"]]
        for r in results:
            for i, g in enumerate(r["grads"]):
                steps[i].update(g)
        return steps
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r[key])
    return merged


@pytest.fixture(scope="module")
def reference(qwen3_path) -> dict[str, Any]:
    return run_distributed(_train_lora, 1, qwen3_path, "archon:d1")[0]


@pytest.fixture(scope="module")
def moe_reference(moe_path) -> dict[str, Any]:
    return run_distributed(_train_lora, 1, moe_path, "archon:d1")[0]


@pytest.mark.parametrize(
    "backend,checkpointing", [("archon:d2", False), ("archon:t2", False), ("archon:p2", False), ("archon:c2", True)]
)
def test_lora_matches_single_device(qwen3_path, reference, backend, checkpointing):
    _assert_matches(run_distributed(_train_lora, 2, qwen3_path, backend, checkpointing), reference)


def test_lora_on_a_moe_model_under_expert_parallel_matches_single_device(moe_path, moe_reference):
    adapted = {n.rsplit(".", 1)[0] for n in moe_reference["adapters"]}
    assert adapted and all(".attention." in n for n in adapted), sorted(adapted)  # no expert or router adapters
    _assert_matches(run_distributed(_train_lora, 2, moe_path, "archon:d2e2"), moe_reference)


def _assert_matches(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    losses = results[0]["losses"]
    assert max(abs(a - b) for a, b in zip(losses, reference["losses"])) < 1e-4, (losses, reference["losses"])
    ref_grads = reference["grads"]
    got_grads = _merged(results, "grads")
    assert len(got_grads) == len(ref_grads) == STEPS
    for ref_step, got_step in zip(ref_grads, got_grads):
        assert got_step.keys() == ref_step.keys()
        for name, g in ref_step.items():
            assert g.abs().max() > 0, name  # B random: both A's and B's gradients are non-trivial
            torch.testing.assert_close(got_step[name], g, atol=1e-4, rtol=1e-4, msg=name)
    got = _merged(results, "adapters")
    for name, a in reference["adapters"].items():
        torch.testing.assert_close(got[name], a, atol=1e-4, rtol=1e-4, msg=name)


def _lora_losses(path: str, compile_blocks: bool) -> list[float]:
    from archon.engine.engine import ArchonEngine

    cfg = lora_config(path, "archon:d1")
    cfg.archon.enable_compile = compile_blocks
    cfg.mb_spec.max_tokens_per_mb = 128  # fixed shapes (pad_to_maximum under compile): one block graph
    engine = ArchonEngine(cfg, total_steps=STEPS + 1).initialize()
    assert engine.model is not None
    blocks = list(engine.model.get_submodule("layers").children())
    # Module.compile sets _compiled_call_impl: every block (adapters inside, fullgraph) is compiled, or none.
    assert all((getattr(b, "_compiled_call_impl", None) is not None) == compile_blocks for b in blocks)
    return [engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in range(STEPS + 1)]


@pytest.mark.slow  # one compiled block graph: ~25 s cold on CPU
def test_lora_under_compile_matches_eager(qwen3_path):
    eager = run_distributed(_lora_losses, 1, qwen3_path, False)[0]
    compiled = run_distributed(_lora_losses, 1, qwen3_path, True, timeout=900)[0]
    assert max(abs(a - b) for a, b in zip(compiled, eager)) < 1e-4, (compiled, eager)
