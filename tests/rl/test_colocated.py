"""Colocated rollout servers (``rollout.colocate``): servers and trainer take turns, with the same results.

The reference is the separate layout with the same seed (a built-in server of its own, a broadcast weight sync):
colocation changes where the processes sit and who holds memory when, never what is sampled or trained.  The
hand-overs are checked from the servers' own accounting: they hold their weights and KV cache while generating and
nothing while the trainer trains.
"""

from __future__ import annotations

import pytest
from rl_runs import _run, overrides

_SAME = ("reward_mean", "reward_std", "response_len_mean", "actor/loss", "actor/grad_norm", "actor/entropy")


@pytest.fixture(scope="module")
def separate(rl_setup) -> list[dict]:
    """The reference: the separate layout (a built-in server of its own, a broadcast weight sync), 3 steps."""
    model, data, root = rl_setup
    return _run(1, overrides(model, data, root / "separate", total_train_steps=3))


def test_colocated_run_equals_the_separate_run_and_servers_release_their_memory(rl_setup, separate):
    model, data, root = rl_setup
    colocated = _run(
        1,
        overrides(
            model,
            data,
            root / "colocated",
            total_train_steps=3,
            **{"rollout.colocate": True, "actor.offload": True, "cluster.n_gpus_per_node": 1},
        ),
    )
    for a, b in zip(separate, colocated, strict=True):
        for key in _SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
        # The servers generated with the weights being trained (handed over by reference, bucket by bucket).
        assert b["behav_prox_logprob_diff"] < 1e-5
        assert b["weight_sync_bytes"] == a["weight_sync_bytes"] > 0
        assert b["colocate/server_bytes_generating"] > 0
        assert b["colocate/server_bytes_training"] == 0


def test_two_colocated_servers_load_the_weights_of_their_own_ranks(rl_setup, separate):
    # archon:d2 with a server on each rank's GPU: every rank shares its own copy of each bucket and server i maps
    # rank i's (TensorWeightSync).  Against the d1 reference: the allocation moves float32 reductions only
    # (relative 1e-4, as the allocation tests allow).
    model, data, root = rl_setup
    colocated = _run(
        2,
        overrides(
            model,
            data,
            root / "colocated2",
            "archon:d2",
            total_train_steps=2,
            **{"rollout.backend": "local:d2", "rollout.colocate": True, "cluster.n_gpus_per_node": 2},
        ),
    )
    for a, b in zip(separate[:2], colocated, strict=True):
        for key in _SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key)
        assert b["behav_prox_logprob_diff"] < 1e-5  # both servers generated with the trained weights
        assert b["weight_sync_bytes"] == a["weight_sync_bytes"] > 0
