"""ArchonEngine: training does not depend on the allocation, microbatching, AC or FSDP policy.

Every layout is compared with the single-device run (``archon:d1``) of the same seed and data:
per-step losses agree within 1e-4 in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from engine_utils import (
    capture_log,
    engine_config,
    export_after_one_step,
    forward_outputs,
    make_batch,
    resume_losses,
    sft_loss,
    sft_weight,
)
from hf_fixtures import save_tiny_hf

STEPS = 3
VARIANTS: dict[str, dict] = {
    "base": {},
    "ac_full": {"gradient_checkpointing": True},
    "ac_selective_op": {
        "gradient_checkpointing": True,
        "archon": {"ac_mode": "selective", "selective_ac_option": "op"},
    },
    "reshard_always": {"archon": {"reshard_after_forward_policy": "always"}},
    "reshard_never": {"archon": {"reshard_after_forward_policy": "never"}},
    "n_mbs_3": {"mb_spec": {"n_mbs": 3}},
}


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf(folder, "qwen3", seed=3)
    return str(folder)


def _train_variants(path: str, backend: str, names: list[str]) -> dict[str, dict[str, list[float]]] | None:
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    out = {}
    for name in names:
        engine = ArchonEngine(engine_config(path, backend, **VARIANTS[name]), total_steps=STEPS).initialize()
        stats = [engine.train_batch(make_batch(s), sft_loss, sft_weight) for s in range(STEPS)]
        # Gradient norms too: AdamW barely reacts to a gradient off by a constant factor, losses would not show it.
        out[name] = {"loss": [st["loss"] for st in stats], "grad_norm": [st["grad_norm"] for st in stats]}
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def reference_run(qwen3_path) -> dict[str, list[float]]:
    return run_distributed(_train_variants, 1, qwen3_path, "archon:d1", ["base"])[0]["base"]


@pytest.fixture(scope="module")
def reference_losses(reference_run) -> list[float]:
    return reference_run["loss"]


def test_reference_first_loss_is_the_plain_model_nll(qwen3_path, reference_losses):
    import models

    model = models.load_hf_model(qwen3_path)
    batch = make_batch(0)
    total, count = 0.0, 0.0
    for b in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][b].sum())
        ids = batch["input_ids"][b, :n]
        with torch.no_grad():
            logp = F.log_softmax(model(ids[None])[0].float(), -1)
        tok_lp = logp[:-1].gather(-1, ids[1:, None])[:, 0]
        mask = batch["loss_mask"][b, 1:n]
        total += float(-(tok_lp * mask).sum())
        count += float(mask.sum())
    assert abs(reference_losses[0] - total / count) < 1e-5
    assert reference_losses[-1] < reference_losses[0]  # it trains


@pytest.mark.parametrize(
    "backend, world, names",
    [
        ("archon:d1", 1, ["ac_full", "ac_selective_op", "n_mbs_3"]),
        ("archon:d2", 2, list(VARIANTS)),
        ("archon:t2", 2, ["base", "ac_full", "n_mbs_3"]),
        ("archon:d2t2", 4, list(VARIANTS)),
        ("archon:d4", 4, ["base", "ac_full", "reshard_always", "n_mbs_3"]),
    ],
)
def test_losses_do_not_depend_on_allocation(qwen3_path, reference_run, backend, world, names):
    result = run_distributed(_train_variants, world, qwen3_path, backend, names)[0]
    for name, run in result.items():
        for key in ("loss", "grad_norm"):
            diff = max(abs(a - b) for a, b in zip(run[key], reference_run[key]))
            assert diff < 1e-4, f"{backend} {name} {key}: {run[key]} vs d1 {reference_run[key]}"


def test_forward_logprobs_match_across_layouts(qwen3_path):
    ref = run_distributed(forward_outputs, 1, qwen3_path, "archon:d1")[0]
    got = run_distributed(forward_outputs, 4, qwen3_path, "archon:d2t2")[0]
    batch = make_batch(7, n=5)
    mask = batch["attention_mask"].bool()
    assert torch.all(ref["logprobs"][:, 0] == 0)
    assert torch.all(ref["logprobs"][mask] <= 0)
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(got[key][mask], ref[key][mask], atol=1e-5, rtol=1e-5)


def test_resume_across_allocations_matches_uninterrupted(qwen3_path, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(resume_losses, 4, qwen3_path, ckpt, "full", "archon:d2t2")[0]
    first = run_distributed(resume_losses, 4, qwen3_path, ckpt, "first", "archon:d2t2")[0]
    second = run_distributed(resume_losses, 4, qwen3_path, ckpt, "second", "archon:d4")[0]
    resumed = first + second
    assert max(abs(a - b) for a, b in zip(full, resumed)) < 1e-5, (full, resumed)


def test_export_hf_from_sharded_equals_single_device(qwen3_path, tmp_path):
    from transformers import AutoModelForCausalLM

    import models

    run_distributed(export_after_one_step, 1, qwen3_path, "archon:d1", str(tmp_path / "d1"))
    run_distributed(export_after_one_step, 4, qwen3_path, "archon:d2t2", str(tmp_path / "d2t2"))
    a = models.load_hf_model(tmp_path / "d1").state_dict()
    b = models.load_hf_model(tmp_path / "d2t2").state_dict()
    assert a.keys() == b.keys()
    for key in a:
        # One AdamW step moves weights by ~lr*sign(grad): rounding-level grad differences show at 1e-5.
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4)
    # The source folder's generation config (EOS ids, sampling defaults) travels with the export.
    assert (tmp_path / "d2t2" / "generation_config.json").read_text() == (
        Path(qwen3_path) / "generation_config.json"
    ).read_text()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "d2t2")
    ids = make_batch(1)["input_ids"][:1]
    ours = models.load_hf_model(tmp_path / "d2t2")(ids)
    torch.testing.assert_close(hf(ids).logits, ours, atol=1e-5, rtol=1e-5)


def _skip_and_tokens(path: str, backend: str):
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    records = capture_log("archon.engine")
    engine = ArchonEngine(engine_config(path, backend, mb_spec={"max_tokens_per_mb": 24}), total_steps=3).initialize()
    assert engine.model is not None
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    def nan_loss(outputs, mb):
        loss, stats = sft_loss(outputs, mb)
        return loss * float("nan"), stats

    skipped = engine.train_batch(make_batch(0), nan_loss, sft_weight)
    unchanged = all(torch.equal(before[n], p.detach()) for n, p in engine.model.named_parameters())
    stats = engine.train_batch(make_batch(1), sft_loss, sft_weight)
    return (skipped, unchanged, stats, records) if dist.get_rank() == 0 else None


def test_non_finite_step_is_skipped_and_token_bound_microbatches_match(qwen3_path):
    """A NaN gradient skips the update (weights untouched, reported); max_tokens_per_mb gives d1's losses."""
    skipped, unchanged, stats, records = run_distributed(_skip_and_tokens, 4, qwen3_path, "archon:d2t2")[0]
    assert skipped["update_skipped"] == 1.0 and not torch.isfinite(torch.tensor(skipped["grad_norm"]))
    assert unchanged
    assert stats["update_skipped"] == 0.0
    assert any("non-finite gradient norm" in r for r in records)
    assert "Initialized Archon engine with parallel dims: pp=1, dp_shard=2, tp=2, cp=1, ep=1, etp=1" in records

    # The second step saw the same weights as d1's first step, so its loss is d1's step-1 loss
    # on batch 1: recompute it single-process with plain n_mbs=1.
    def first_loss_on_batch1(path: str):
        from archon.engine.engine import ArchonEngine

        engine = ArchonEngine(engine_config(path, "archon:d1"), total_steps=3).initialize()
        return engine.train_batch(make_batch(1), sft_loss, sft_weight)["loss"]

    ref = run_distributed(first_loss_on_batch1, 1, qwen3_path)[0]
    assert abs(stats["loss"] - ref) < 1e-5


def _bf16_losses(path: str, backend: str):
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = engine_config(path, backend, archon={"pp_schedule": "1F1B"})
        cfg.dtype = dtype
        engine = ArchonEngine(cfg, total_steps=2).initialize()
        out[dtype] = [engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in range(2)]
    return out if dist.get_rank() == 0 else None


def test_bfloat16_means_low_precision_compute_with_or_without_fsdp(qwen3_path):
    """actor.dtype = bfloat16 is FSDP's param dtype on d2 and autocast on d1: both really compute in
    bf16 (losses move away from float32 by a bf16-sized amount) and agree with each other."""
    d1 = run_distributed(_bf16_losses, 1, qwen3_path, "archon:d1")[0]
    d2 = run_distributed(_bf16_losses, 2, qwen3_path, "archon:d2")[0]
    p2 = run_distributed(_bf16_losses, 2, qwen3_path, "archon:p2")[0]  # autocast around the schedule
    for run in (d1, d2, p2):
        gap = max(abs(a - b) for a, b in zip(run["float32"], run["bfloat16"]))
        assert 1e-4 < gap < 5e-2, run
    assert max(abs(a - b) for a, b in zip(d1["bfloat16"], d2["bfloat16"])) < 5e-2
    # Same autocast math; padding the pipeline microbatches changes bf16 rounding a little.
    assert max(abs(a - b) for a, b in zip(d1["bfloat16"], p2["bfloat16"])) < 5e-3
