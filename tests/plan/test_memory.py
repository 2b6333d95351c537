"""The memory estimate against the bytes the engine really allocates, and the fit check of the recipes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import engine_config
from hf_fixtures import make_tiny_hf_config
from memory_utils import LiveTensorBytes
from paths import REPO

from archon.config import load_config
from archon.plan.fit import check_fit
from archon.plan.memory import GiB, Workload, estimate_training_rank
from archon.plan.params import model_args_of, param_groups, read_model_config

# Wide enough that parameters, activations and the loss all matter (hidden 256, 4 layers).
DENSE: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=512,
    num_hidden_layers=4,
)
MOE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=512,
    num_hidden_layers=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
)
SEQS, SEQ_LEN = 8, 128


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 512, (SEQS, SEQ_LEN), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(SEQS, SEQ_LEN)}


def _loss(outputs, mb):
    mask = mb["loss_mask"]
    return -(outputs["logprobs"] * mask).sum() / mask.sum(), {}


def _measured_peak(cfg) -> int:
    """Peak live tensor bytes of this rank during its second training step (the first creates AdamW's state)."""
    from archon.engine.engine import ArchonEngine

    engine = ArchonEngine(cfg, total_steps=3, device="cpu").initialize()
    weight = lambda mb: float(mb["loss_mask"].sum())  # noqa: E731
    engine.train_batch(_batch(), _loss, weight)
    tracker = LiveTensorBytes()
    tracker.track(engine.model, engine.optimizer)
    with tracker:
        engine.train_batch(_batch(), _loss, weight)
    return tracker.peak


CASES = [
    ("qwen3", "archon:d1", {}),
    ("qwen3", "archon:d1", dict(gradient_checkpointing=True, archon=dict(ac_mode="full"))),
    ("qwen3", "archon:d2", dict(mb_spec=dict(n_mbs=2))),
    ("qwen3", "archon:d1t2", dict(gradient_checkpointing=True, archon=dict(ac_mode="selective"))),
    ("qwen3", "archon:d1p2", dict(mb_spec=dict(n_mbs=4), archon=dict(pp_schedule="Interleaved1F1B"))),
    ("qwen3_moe", "archon:d2e2", {}),
]


@pytest.mark.parametrize(
    "model_type, backend, options", CASES, ids=[f"{m}-{b}-{'-'.join(o) or 'plain'}" for m, b, o in CASES]
)
def test_estimate_is_within_25_percent_of_the_measured_peak(tmp_path, model_type, backend, options):
    folder = tmp_path / "model"
    make_tiny_hf_config(model_type, **(MOE if model_type == "qwen3_moe" else DENSE)).save_pretrained(folder)
    cfg = engine_config("", backend, **options)
    cfg.model_config = str(folder)
    world = 2 if backend != "archon:d1" else 1
    measured = max(run_distributed(_measured_peak, world, cfg))
    hf = json.loads((folder / "config.json").read_text())
    estimate = estimate_training_rank(cfg, hf, Workload(SEQS, SEQ_LEN), device_type="cpu").total
    error = (estimate - measured) / measured
    print(
        f"{model_type} {backend} {options}: measured {measured / 2**20:.2f} MiB, "
        f"estimated {estimate / 2**20:.2f} MiB, error {100 * error:+.1f}%"
    )
    assert abs(error) < 0.25


def test_parameter_counts_are_the_published_ones():
    # Qwen3-8B: 8.19B parameters; Qwen3-30B-A3B: 30.5B (the model cards' figures).
    for folder, billions in (("qwen3_8b", 8.19), ("qwen3_30b_a3b", 30.53)):
        spec, args = model_args_of(read_model_config(REPO / "configs" / "models" / folder))
        assert sum(g.numel for g in param_groups(spec, args)) / 1e9 == pytest.approx(billions, abs=0.01)


def test_recipes_fit_80_gb_gpus(monkeypatch):
    monkeypatch.chdir(REPO)
    for name in ("qwen3_8b_dense.toml", "qwen3_30b_a3b_moe.toml"):
        report = check_fit(load_config(REPO / "configs" / name))
        assert report.train is not None and report.rollout is not None
        assert report.fits, (name, report.train.total / GiB)
        # One rollout GPU holds a t-th of the bf16 weights: 30.53e9 * 2 / 4 bytes for the MoE recipe.
        if "moe" in name:
            assert report.rollout.terms[0].bytes == pytest.approx(30.53e9 * 2 / 4, rel=1e-3)


def test_a_misfit_names_its_largest_term_and_fixes_that_were_checked(monkeypatch):
    monkeypatch.chdir(REPO)
    base = ["actor.mb_spec.n_mbs=8"]
    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b_moe.toml", base)
    report = check_fit(cfg)
    assert not report.fits_train()
    assert report.train is not None
    assert report.verdict(report.train).startswith("does not fit") and "activations" in report.verdict(report.train)
    assert report.fixes
    for fix in report.fixes:
        overrides = fix.split(" (")[0].split()
        assert check_fit(load_config(REPO / "configs" / "qwen3_30b_a3b_moe.toml", base + overrides)).fits_train()


def test_sft_estimate_counts_no_rollout_and_only_the_actor(monkeypatch):
    monkeypatch.chdir(REPO)
    overrides = ["cluster.n_nodes=2", "actor.kl_ctl=0.1"]
    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b_moe.toml", overrides, job="sft")
    report = check_fit(cfg, "sft")
    assert report.train is not None
    assert report.rollout is None and not any(t.name.startswith("ref") for t in report.train.terms)
    rl = check_fit(load_config(REPO / "configs" / "qwen3_30b_a3b_moe.toml", overrides[1:]))
    assert rl.train is not None
    assert any(t.name.startswith("ref parameters") for t in rl.train.terms)
