"""The in-process rollout engine (``rollout.backend = "inprocess:d1"``): generation on the actor's own weights.

Its reference is the same run with a built-in rollout server (``local:d1``, its own process, weights synced after
every step): the server and the in-process engine are one generator behind one protocol, so with the same seed the
runs sample the same tokens and train to the same metrics.
"""

from __future__ import annotations

import pytest
from rl_runs import _run, overrides

# Measures of the run that must agree: what was sampled, what it was scored, what the update did.
_SAME = ("reward_mean", "reward_std", "response_len_mean", "actor/loss", "actor/grad_norm", "actor/entropy")


def test_inprocess_run_equals_the_run_with_a_rollout_server(rl_setup):
    model, data, root = rl_setup
    served = _run(1, overrides(model, data, root / "served", total_train_steps=3))
    inproc = _run(
        1, overrides(model, data, root / "inproc", total_train_steps=3, **{"rollout.backend": "inprocess:d1"})
    )
    assert len(served) == len(inproc) == 3
    for a, b in zip(served, inproc):
        for key in _SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
        # The trainer recomputes what the engine sampled with the same weights: no mismatch, ratio one.
        assert b["behav_prox_logprob_diff"] < 1e-5
        assert b["weight_sync_bytes"] == 0.0
    assert inproc[-1]["actor/grad_norm"] > 0 and inproc[-1]["reward_std"] > 0  # the runs really train


def test_data_parallel_inprocess_run_equals_the_run_with_a_rollout_server(rl_setup):
    # archon:d2 shards the weights; rank 0 generates on the gathered ones while the other waits.
    model, data, root = rl_setup
    served = _run(2, overrides(model, data, root / "served_d2", backend="archon:d2", total_train_steps=2))
    inproc = _run(
        2,
        overrides(
            model,
            data,
            root / "inproc_d2",
            backend="archon:d2",
            total_train_steps=2,
            **{"rollout.backend": "inprocess:d2"},
        ),
    )
    for a, b in zip(served, inproc, strict=True):
        for key in _SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
        assert b["behav_prox_logprob_diff"] < 1e-5
