"""The RL loop end to end on CPU: built-in rollout server, engines, weight sync, metrics, resume.

Trainer ranks are forked gloo processes (``run_distributed``); each run launches its own
built-in server subprocess (``local:d1``) exactly as ``scripts/train_rl.py`` would.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from dist_utils import run_distributed
from rl_runs import _run, _train_expecting_failure, overrides


def test_on_policy_step_has_ratio_one_and_server_logprobs_match_trainer(rl_setup):
    model, data, root = rl_setup
    history = _run(1, overrides(model, data, root / "onpolicy", total_train_steps=2))
    for record in history:
        # Behaviour logprobs come from the server; the trainer's own recompute of the same tokens
        # with the same weights must agree (the mismatch users watch).
        assert record["behav_prox_logprob_diff"] < 1e-5, record
        assert abs(record["actor/ratio_mean"] - 1.0) < 1e-5 and record["actor/clip_frac"] == 0.0
        assert record["reward_std"] > 0 and record["actor/grad_norm"] > 0  # the step really trains
    records = [json.loads(line) for line in (root / "onpolicy" / "metrics.jsonl").read_text().splitlines()]
    for key in (
        "step",
        "reward_mean",
        "reward_std",
        "response_len_mean",
        "actor/loss",
        "actor/clip_frac",
        "actor/approx_kl",
        "actor/entropy",
        "actor/grad_norm",
        "kl_ref",
        "rollout_time_s",
        "train_time_s",
        "weight_sync_time_s",
        "step_time_s",
        "behav_prox_logprob_diff",
    ):
        assert key in records[-1], key
    # After step 1 the server runs the updated weights (version "1") and still matches the trainer.
    assert history[1]["behav_prox_logprob_diff"] < 1e-5


def test_reward_functions_get_the_completions_token_ids(rl_setup):
    model, data, root = rl_setup
    history = _run(
        1, overrides(model, data, root / "token_ids", total_train_steps=1, **{"reward.fn": "reward_fns:token_count"})
    )
    # The reward counts the ids it was given; the trainer counts the tokens it trains on.
    assert history[0]["reward_mean"] == pytest.approx(history[0]["response_len_mean"])
    assert history[0]["response_len_max"] > 1


def test_grpo_losses_do_not_depend_on_the_allocation(rl_setup):
    model, data, root = rl_setup
    extra: dict[str, Any] = dict(
        total_train_steps=3, **{"actor.ppo_n_minibatches": 2, "actor.kl_ctl": 0.05, "actor.recompute_logprob": True}
    )
    d1 = _run(1, overrides(model, data, root / "inv_d1", **extra))
    # The reference model gets its own allocation over the same ranks.
    for actor, ref in [("archon:d2", "archon:t2"), ("archon:c2", "archon:d2"), ("archon:p2", "archon:d2")]:
        out = root / f"inv_{actor.split(':')[1]}"
        other = _run(
            2, overrides(model, data, out, actor, **{**extra, "ref.backend": ref, "actor.archon.pp_schedule": "1F1B"})
        )
        for key in ("actor/loss", "reward_mean", "kl_ref", "actor/grad_norm", "actor/entropy"):
            a = [r[key] for r in d1]
            b = [r[key] for r in other]
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (actor, key, a, b)
    assert d1[-1]["kl_ref"] > 0  # the policy moved away from the reference


def test_dynamic_filter_adaptive_kl_and_shuffled_epochs_resume_exactly_on_another_allocation(rl_setup):
    model, data, root = rl_setup
    extra = {
        "total_train_steps": 3,
        # The prompts wrapped in the tiny tokenizer's chat template: with them, step 1's completions give groups of
        # equal rewards, so the filter drops and refills before the checkpoint (asserted below).
        "train_dataset.apply_chat_template": True,
        "reward.fn": "reward_fns:crc_quarter",
        "dynamic_filter.enable": True,
        "dynamic_filter.max_num_gen_batches": 3,
        "actor.kl_ctl": 0.05,
        "actor.kl_ctl_type": "adaptive",
        "actor.kl_ctl_horizon": 100.0,
        "actor.ppo_epochs": 2,
        "actor.shuffle": True,
        "actor.ppo_n_minibatches": 2,
        "actor.recompute_logprob": True,
        "saver.freq_steps": 1,
    }
    full = _run(1, overrides(model, data, root / "dyn_full", **extra))
    # The filter really dropped groups and refilled before the checkpoint the resumed run starts from,
    # so resuming exactly needs the loader position to include the extra prompts.
    assert full[0]["dynamic_filter/refills"] >= 1 and full[0]["dynamic_filter/dropped_groups"] >= 1, full[0]
    for r in full:
        assert r["n_samples"] == 16 and 0 < r["reward_mean"] < 1  # a full batch of mixed groups
    # The adaptive coefficient follows verl's rule: the step-1 KL is 0 (policy = reference), far below
    # the target, so the coefficient shrinks by the clipped 20% times 16 samples / horizon 100.
    coefs = [r["kl_ctl"] for r in full]
    assert full[0]["kl_penalty"] == 0.0 and coefs[0] == 0.05 and coefs[1] == pytest.approx(0.05 * (1 - 0.2 * 0.16))
    error = min(max(full[1]["kl_penalty"] / 0.1 - 1, -0.2), 0.2)
    assert coefs[2] == pytest.approx(coefs[1] * (1 + error * 0.16)) and coefs[2] != coefs[1]
    out = root / "dyn_resumed"
    _run(1, overrides(model, data, out, **extra) + ["total_train_steps=1"])
    resumed = _run(2, overrides(model, data, out, "archon:d2", **extra))
    assert [r["step"] for r in resumed] == [2, 3]
    for key in (
        "actor/loss",
        "actor/grad_norm",
        "reward_mean",
        "kl_ctl",
        "kl_penalty",
        "dynamic_filter/rounds",
        "dynamic_filter/dropped_groups",
    ):
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in full[1:]], abs=1e-4), key


def test_ppo_with_critic_trains_the_value_head(rl_setup):
    model, data, root = rl_setup
    # Every completion earns 1 and rewards are not normalised (PPO's default): when truncation ends
    # the episode (verl's convention, no bootstrap), the return of every state is 1, so the value
    # loss 0.5 * (V - 1)^2 must fall as the critic learns it.
    history = _run(
        1,
        overrides(
            model,
            data,
            root / "ppo",
            total_train_steps=4,
            **{
                "reward.fn": "reward_fns:one",
                "actor.adv_estimator": "gae",
                "actor.gae_lambda": 1.0,
                "actor.bootstrap_truncated": False,
                "critic.optimizer.lr": 5e-3,
                "critic.ppo_n_minibatches": 2,
            },
        ),
    )
    losses = [r["critic/value_loss"] for r in history]
    assert max(losses[1:]) < 0.2 * losses[0], losses
    assert history[-1]["critic/returns_mean"] == pytest.approx(1.0)


def test_rank0_failures_end_every_rank_with_the_same_reason(rl_setup):
    model, data, root = rl_setup
    # Nothing listens on port 9: rank 0 cannot reach the servers; rank 1 must not wait for it forever.
    args = overrides(model, data, root / "unreachable", "archon:d2", **{"rollout.setup_timeout": 2.0}) + [
        'rollout.server_addrs=["127.0.0.1:9"]'
    ]
    errors = run_distributed(_train_expecting_failure, 2, args, timeout=300)
    assert all("starting the rollout servers failed on rank 0" in e for e in errors), errors
    assert errors[0] == errors[1] and "127.0.0.1:9" in errors[0]
    errors = run_distributed(
        _train_expecting_failure,
        2,
        overrides(model, data, root / "badfn", "archon:d2", **{"reward.fn": "no_such_module:fn"}),
        timeout=300,
    )
    assert all("no_such_module" in e for e in errors), errors
