"""actor.proximal_from_update: the proximal logprobs of a one-step update come from its own forward.

The reference is the same run with the separate recompute pass (``proximal_from_update = false``):
every loss, gradient norm and proximal metric must agree, under one rank and under two (where the
ratio's min and max are reduced over the ranks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rl_runs import _run, overrides

from archon.rl.offpolicy import behaviour_ratio_metrics, proximal_metrics, proximal_sums

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Stale data (k = 1, each round from one version: deterministic), so pi_prox != pi_behav.
_ASYNC: dict[str, Any] = {
    "total_train_steps": 3,
    "rollout.max_head_offpolicyness": 1,
    "rollout.partial_rollout": False,
    "actor.use_decoupled_loss": True,
    "actor.ppo_n_minibatches": 1,
    "actor.mb_spec.max_tokens_per_mb": 64,  # several microbatches per update
}
_KEYS = (
    "actor/loss",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/behav_imp_weight",
    "actor/clip_frac",
    "reward_mean",
    "behav_prox_logprob_diff",
    "behav_ratio/mean",
    "behav_ratio/std",
    "behav_ratio/min",
    "behav_ratio/max",
)


def _assert_close(a: list[dict], b: list[dict], tol: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for key in _KEYS:
        x, y = [r[key] for r in a], [r[key] for r in b]
        # Relative past 1: behav_ratio/max is exp(a logprob gap) ~ 8, which scales the gap's last-bit difference.
        assert max(abs(p - q) / max(1.0, abs(p)) for p, q in zip(x, y)) < tol, (key, x, y)


def test_one_step_updates_match_the_separate_recompute_on_one_and_two_ranks(rl_setup):
    model, data, root = rl_setup
    separate = _run(1, overrides(model, data, root / "prox_sep", **{**_ASYNC, "actor.proximal_from_update": False}))
    fused = _run(1, overrides(model, data, root / "prox_fused", **_ASYNC))
    assert separate[1]["behav_ratio/max"] > 1.0 > separate[1]["behav_ratio/min"]  # the ratios are not trivial
    _assert_close(separate, fused, 1e-5)
    fused_d2 = _run(2, overrides(model, data, root / "prox_fused_d2", "archon:d2", **_ASYNC))
    _assert_close(separate, fused_d2, 1e-4)


def test_synchronous_runs_match_and_report_no_ratio_statistics(rl_setup):
    model, data, root = rl_setup
    extra: dict[str, Any] = {"actor.use_decoupled_loss": True, "total_train_steps": 2}
    separate = _run(1, overrides(model, data, root / "prox_sync_sep", **{**extra, "actor.proximal_from_update": False}))
    fused = _run(1, overrides(model, data, root / "prox_sync_fused", **extra))
    for a, b in zip(separate, fused):
        assert not any(k.startswith("behav_ratio/") for k in b)
        for key in ("actor/loss", "actor/grad_norm", "behav_prox_logprob_diff", "actor/ratio_mean"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key


def test_microbatch_sums_add_up_to_the_whole_batch_metrics():
    """Split a batch into uneven microbatches, weigh their sums as the engine does, and compare
    with the metrics of the whole batch computed at once."""
    g = torch.Generator().manual_seed(0)
    prox = -torch.rand(7, 6, generator=g) * 3
    behav = prox + 0.3 * torch.randn(7, 6, generator=g)
    mask = (torch.rand(7, 6, generator=g) > 0.3).float()
    mask[3] = 0  # a row without loss tokens
    for weigh in ("tokens", "rows"):  # token-mean and sequence-mean loss weights

        def weight(rows: slice, weigh: str = weigh) -> float:
            m = mask[rows] > 0
            return float(m.sum()) if weigh == "tokens" else float(m.any(dim=-1).sum())

        total = weight(slice(None))
        reduced: dict[str, float] = {}
        for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):
            w = weight(rows)
            for key, value in proximal_sums(prox[rows], behav[rows], mask[rows], w).items():
                v = float(value)
                if key.endswith("/max"):
                    reduced[key] = max(reduced.get(key, v), v)
                elif key.endswith("/min"):
                    reduced[key] = min(reduced.get(key, v), v)
                else:
                    reduced[key] = reduced.get(key, 0.0) + v * w / total
        got = proximal_metrics(reduced, int(mask.sum()))
        expected = behaviour_ratio_metrics(prox, behav, mask)
        expected["behav_prox_logprob_diff"] = float(((prox.double() - behav.double()).abs() * mask).sum() / mask.sum())
        assert got.keys() == expected.keys() and not reduced
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-9), key
