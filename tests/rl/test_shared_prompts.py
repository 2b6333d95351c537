"""GRPO with ``actor.archon.prefix_sharing``: each prompt's samples trained with the prompt packed once give the
run of the plain packing (same seed: the same rollouts, losses, gradient norms, entropies).  The shared run is on
``archon:d2``, where the planner keeps each prompt's samples on one rank, the plain one on ``archon:d1``: the
allocation moves float32 reductions only (relative 1e-4, as the allocation tests allow)."""

from __future__ import annotations

import pytest
from rl_runs import _run, overrides

_SAME = ("reward_mean", "actor/loss", "actor/grad_norm", "actor/entropy", "behav_prox_logprob_diff")


def test_grpo_with_shared_prompts_equals_the_plain_run(rl_setup):
    model, data, root = rl_setup
    plain = _run(1, overrides(model, data, root / "plain"))
    shared = _run(2, overrides(model, data, root / "shared", "archon:d2", **{"actor.archon.prefix_sharing": True}))
    for a, b in zip(plain, shared, strict=True):
        for key in _SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key, a[key], b[key])
