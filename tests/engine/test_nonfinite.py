"""A non-finite loss or gradient skips the optimizer step and says so, under every layout family.

One 2-rank layout per parallel dimension (d, t, p, c, and e on the MoE model).  Step 1's loss
is NaN; step 2's loss is finite but its gradient is not (``sqrt`` at 0 inside the graph).  Both
steps must report ``update_skipped`` and a warning on every rank and leave every rank's weights
bit-for-bit unchanged; step 3 is a normal step on weights nobody touched, so its loss and
gradient norm equal a single device's first step on the same batch, and step 2's reported loss
equals a single device's loss on its batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import capture_log, engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf

LAYOUTS = [
    ("archon:d2", "qwen3"),
    ("archon:t2", "qwen3"),
    ("archon:p2", "qwen3"),
    ("archon:c2", "qwen3"),
    ("archon:d2e2", "qwen3_moe"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    out = {}
    for model_type, seed in (("qwen3", 3), ("qwen3_moe", 5)):
        folder = tmp_path_factory.mktemp(model_type)
        save_tiny_hf(folder, model_type, seed=seed)
        out[model_type] = str(folder)
    return out


def _nan_loss(outputs, mb):
    loss, stats = sft_loss(outputs, mb)
    return loss * float("nan"), stats


def _nan_gradient(outputs, mb):
    loss, stats = sft_loss(outputs, mb)
    # Adds 0 to the loss, but d sqrt(u)/du is infinite at u = 0: every gradient becomes NaN.
    return loss + torch.sqrt(0.0 * outputs["logprobs"].sum()), stats


def _local_weights(engine) -> dict[str, torch.Tensor]:
    return {
        n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in engine.model.named_parameters()
    }


def _skip_steps(path: str, backend: str):
    from archon.engine.engine import ArchonEngine

    records = capture_log("archon.engine")
    engine = ArchonEngine(engine_config(path, backend, archon={"pp_schedule": "1F1B"}), total_steps=3).initialize()
    start = _local_weights(engine)

    def unchanged() -> bool:
        now = _local_weights(engine)
        return now.keys() == start.keys() and all(torch.equal(now[n], start[n]) for n in start)

    stats = [engine.train_batch(make_batch(0), _nan_loss, sft_weight)]
    after_nan_loss = unchanged()
    stats.append(engine.train_batch(make_batch(1), _nan_gradient, sft_weight))
    after_nan_grad = unchanged()
    stats.append(engine.train_batch(make_batch(2), sft_loss, sft_weight))
    warnings = sum("non-finite gradient norm" in r for r in records)
    return stats, after_nan_loss, after_nan_grad, unchanged(), warnings


def _first_step(path: str, batches: list[int]) -> list[dict[str, float]]:
    """A single device's first-step stats on each batch (a fresh engine per batch)."""
    from archon.engine.engine import ArchonEngine

    out = []
    for b in batches:
        engine = ArchonEngine(engine_config(path, "archon:d1"), total_steps=3).initialize()
        out.append(engine.train_batch(make_batch(b), sft_loss, sft_weight))
    return out


@pytest.fixture(scope="module")
def references(paths) -> dict[str, list[dict[str, float]]]:
    return {t: run_distributed(_first_step, 1, p, [1, 2])[0] for t, p in paths.items()}


@pytest.mark.parametrize("backend, model_type", LAYOUTS, ids=[b for b, _ in LAYOUTS])
def test_non_finite_loss_or_gradient_skips_the_step_on_every_rank(paths, references, backend, model_type):
    ref_batch1, ref_batch2 = references[model_type]
    for rank, (stats, after_nan_loss, after_nan_grad, after_step3, warnings) in enumerate(
        run_distributed(_skip_steps, 2, paths[model_type], backend)
    ):
        nan_loss, nan_grad, normal = stats
        where = f"{backend} rank {rank}"
        assert nan_loss["update_skipped"] == 1.0 and math.isnan(nan_loss["loss"]), where
        assert not math.isfinite(nan_loss["grad_norm"]), where
        assert nan_grad["update_skipped"] == 1.0 and not math.isfinite(nan_grad["grad_norm"]), where
        assert nan_grad["loss"] == pytest.approx(ref_batch1["loss"], abs=1e-4), where  # the loss itself was fine
        assert after_nan_loss and after_nan_grad, where  # no weight moved
        assert warnings == 2, where  # reported on every rank, once per skipped step
        assert normal["update_skipped"] == 0.0 and not after_step3, where  # training goes on
        assert normal["loss"] == pytest.approx(ref_batch2["loss"], abs=1e-4), where
        assert normal["grad_norm"] == pytest.approx(ref_batch2["grad_norm"], abs=1e-4), where
