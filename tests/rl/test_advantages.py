"""Advantage estimators against hand-computed numbers and plain-Python references."""

import dataclasses
import math
import statistics
from typing import Any, cast

import pytest
import torch

from archon.config import ActorConfig, NormConfig, default_norms
from archon.rl.advantages import (
    check_advantage_options,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    normalize,
    overlong_penalty,
    rloo_rewards,
    shape_rewards,
    token_rewards,
)
from archon.rl.rollout_batch import TURN_REWARDS

EPS = 1e-5


def mask_from(rows):
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------------------------------
# normalisation
# ---------------------------------------------------------------------------------------


def test_group_mean_std_matches_statistics_module():
    r = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    out = normalize(torch.tensor(r), mean_level="group", std_level="group", group_size=4)
    expected = []
    for g in (r[:4], r[4:]):
        mean, std = statistics.mean(g), statistics.stdev(g)  # stdev: n-1 denominator
        expected += [(x - mean) / (std + EPS) for x in g]
    # Hand check of the first group: mean 0.25, unbiased std 0.5.
    assert expected[0] == pytest.approx(0.75 / (0.5 + EPS))
    torch.testing.assert_close(out, torch.tensor(expected))


def test_batch_level_and_biased_std():
    r = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0]
    out = normalize(torch.tensor(r), mean_level="batch", std_level="batch", std_unbiased=False, group_size=2)
    mean, std = statistics.mean(r), statistics.pstdev(r)
    torch.testing.assert_close(out, torch.tensor([(x - mean) / (std + EPS) for x in r]))


def _areal_std(centred, unit_of, unbiased=True):
    """AReaL's Normalization std: the spread of the centred values (x - the subtracted mean) per unit."""
    sums, counts = {}, {}
    for c, u in zip(centred, unit_of):
        sums[u] = sums.get(u, 0.0) + c * c
        counts[u] = counts.get(u, 0) + 1
    return [math.sqrt(sums[u] / (counts[u] - (1 if unbiased else 0))) for u in unit_of]


def test_group_mean_batch_std_is_the_spread_around_the_subtracted_mean():
    r = [1.0, 3.0, 10.0, 14.0]
    out = normalize(torch.tensor(r), mean_level="group", std_level="batch", group_size=2)
    centred = [1 - 2, 3 - 2, 10 - 12, 14 - 12]
    # By hand: sum of squares 1 + 1 + 4 + 4 = 10 over n - 1 = 3 (AReaL), not the batch's own stdev.
    assert _areal_std(centred, [0] * 4)[0] == pytest.approx(math.sqrt(10 / 3))
    std = _areal_std(centred, [0] * 4)
    torch.testing.assert_close(out, torch.tensor([c / (s + EPS) for c, s in zip(centred, std)]))


def test_mean_none_and_leave_one_out_std_follow_areal():
    r = [1.0, 2.0, 3.0, 6.0]
    # No centring: the std is the root mean square around 0.
    out = normalize(torch.tensor(r), mean_level=None, std_level="batch")
    std = math.sqrt(sum(x * x for x in r) / 3)
    torch.testing.assert_close(out, torch.tensor([x / (std + EPS) for x in r]))
    # Leave-one-out mean, group std: the spread of x_i - mean(others).
    out = normalize(torch.tensor(r), mean_level="group", std_level="group", mean_leave1out=True, group_size=4)
    centred = [x - (sum(r) - x) / 3 for x in r]
    std = _areal_std(centred, [0] * 4)
    torch.testing.assert_close(out, torch.tensor([c / (s + EPS) for c, s in zip(centred, std)]))
    # Batch mean, group std: each group's spread around the batch mean.
    out = normalize(torch.tensor(r), mean_level="batch", std_level="group", group_size=2)
    centred = [x - 3.0 for x in r]
    std = _areal_std(centred, [0, 0, 1, 1])
    torch.testing.assert_close(out, torch.tensor([c / (s + EPS) for c, s in zip(centred, std)]))


def test_leave_one_out_mean_and_dr_grpo_mean_only():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])
    loo = normalize(r, mean_level="group", std_level=None, mean_leave1out=True, group_size=4)
    # Each baseline is the mean of the other three: 11/3, 10/3, 9/3, 6/3.
    torch.testing.assert_close(loo, torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3]))
    torch.testing.assert_close(rloo_rewards(r, group_size=4), loo)
    dr = normalize(r, mean_level="group", std_level=None, group_size=2)
    torch.testing.assert_close(dr, torch.tensor([-0.5, 0.5, -1.5, 1.5]))


def test_degenerate_groups():
    # Identical rewards: zero advantage, no NaN.  Group of one: leave-one-out mean is 0 and
    # the unbiased std is undefined, so the value is left unscaled.
    same = normalize(torch.tensor([1.0, 1.0, 0.0, 0.0]), mean_level="group", std_level="group", group_size=2)
    torch.testing.assert_close(same, torch.zeros(4))
    single = normalize(
        torch.tensor([2.0, -3.0]), mean_level="group", std_level="group", mean_leave1out=True, group_size=1
    )
    torch.testing.assert_close(single, torch.tensor([2.0, -3.0]))


def test_masked_token_normalisation_batch_and_group():
    x = torch.tensor([[9.0, 1.0, 2.0, 9.0], [9.0, 9.0, 4.0, 7.0], [5.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    m = mask_from([[0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    vals = [1.0, 2.0, 4.0, 7.0, 5.0]
    out = normalize(x, m, mean_level="batch", std_level="batch")
    mean, std = statistics.mean(vals), statistics.stdev(vals)
    expected = torch.zeros_like(x)
    for b in range(4):
        for s in range(4):
            if m[b, s]:
                expected[b, s] = (x[b, s] - mean) / (std + EPS)
    torch.testing.assert_close(out, expected)
    # Group level (2 rows per group): group 0 holds tokens 1,2,4,7; group 1 only token 5.
    out_g = normalize(x, m, mean_level="group", std_level="group", group_size=2)
    g0 = [1.0, 2.0, 4.0, 7.0]
    m0, s0 = statistics.mean(g0), statistics.stdev(g0)
    expected_g = torch.zeros_like(x)
    expected_g[0, 1], expected_g[0, 2] = (1 - m0) / (s0 + EPS), (2 - m0) / (s0 + EPS)
    expected_g[1, 2], expected_g[1, 3] = (4 - m0) / (s0 + EPS), (7 - m0) / (s0 + EPS)
    expected_g[2, 0] = 0.0  # a single token: centred to 0, std undefined
    torch.testing.assert_close(out_g, expected_g)


def test_norm_config_validation():
    assert NormConfig(mean_level="none", std_level="none").is_identity
    x = torch.tensor([1.0, 2.0, 4.0])
    torch.testing.assert_close(normalize(x, mean_level="none", std_level="None"), x)
    with pytest.raises(ValueError, match="mean_level"):
        normalize(x, mean_level="sequence", std_level=None)
    with pytest.raises(ValueError, match="multiple of group_size"):
        normalize(torch.ones(5), mean_level="group", std_level=None, group_size=2)


# ---------------------------------------------------------------------------------------
# reward shaping
# ---------------------------------------------------------------------------------------


def test_shape_rewards_bias_scale_clip():
    r = torch.tensor([1.0, -3.0, 10.0])
    out = shape_rewards(r, reward_bias=0.5, reward_scaling=2.0, reward_clip=5.0)
    # (1 + .5) * 2 = 3 ; (-3 + .5) * 2 = -5 ; (10 + .5) * 2 = 21 -> clipped to 5
    torch.testing.assert_close(out, torch.tensor([3.0, -5.0, 5.0]))


def test_overlong_penalty_dapo():
    lengths = torch.tensor([5, 6, 8, 10])
    pen = overlong_penalty(lengths, overlong_tokens=4, overlong_penalty_factor=1.0, max_new_tokens=10)
    # Penalty window is (6, 10]: 0 up to 6 tokens, then -1/4 per extra token.
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    out = shape_rewards(
        torch.ones(4),
        response_lengths=lengths,
        overlong_reward_penalty=True,
        overlong_tokens=4,
        overlong_penalty_factor=2.0,
        max_new_tokens=10,
    )
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.0, -1.0]))


# ---------------------------------------------------------------------------------------
# token rewards, GAE, returns
# ---------------------------------------------------------------------------------------


def test_token_rewards_place_reward_on_last_loss_token_with_kl():
    m = mask_from([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    kl = torch.full((3, 6), 2.0)
    out = token_rewards(torch.tensor([1.0, -1.0, 5.0]), m, kl=kl, kl_ctl=0.1)
    expected = torch.tensor(
        [[0.0, 0.0, -0.2, -0.2, 0.8, 0.0], [0.0, -0.2, -1.2, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(out, expected)


def test_gae_hand_computed():
    # One row, prompt of 1 token, two completion tokens, then padding.
    m = mask_from([[0, 1, 1, 0]])
    values = torch.tensor([[7.0, 0.5, 0.2, 7.0]])  # values outside the mask must be ignored
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    adv, ret = gae_advantages(rewards, values, m, discount=0.9, gae_lambda=0.5)
    # last:  delta = 1 + 0.9*0 - 0.2 = 0.8                 A = 0.8
    # first: delta = 0 + 0.9*0.2 - 0.5 = -0.32             A = -0.32 + 0.45*0.8 = 0.04
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.04, 0.8, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.54, 1.0, 0.0]]))


def _gae_reference(rewards, values, mask, gamma, lam):
    """Plain-Python GAE over each row's loss positions."""
    B, S = len(rewards), len(rewards[0])
    adv = [[0.0] * S for _ in range(B)]
    for b in range(B):
        pos = [s for s in range(S) if mask[b][s]]
        nxt_v, nxt_a = 0.0, 0.0
        for s in reversed(pos):
            delta = rewards[b][s] + gamma * nxt_v - values[b][s]
            a = delta + gamma * lam * nxt_a
            adv[b][s] = a
            nxt_v, nxt_a = values[b][s], a
    return adv


def test_gae_ragged_batch_and_empty_row():
    torch.manual_seed(0)
    m = mask_from([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0]])
    values = torch.randn(4, 7)
    rewards = token_rewards(torch.tensor([1.0, -0.5, 3.0, 2.0]), m, kl=torch.rand(4, 7), kl_ctl=0.05)
    adv, ret = gae_advantages(rewards, values, m, discount=0.95, gae_lambda=0.8)
    ref = torch.tensor(_gae_reference(rewards.tolist(), values.tolist(), m.tolist(), 0.95, 0.8))
    torch.testing.assert_close(adv, ref)
    torch.testing.assert_close(ret, torch.where(m > 0, ref + values, 0.0))
    assert adv[2].abs().sum() == 0 and ret[2].abs().sum() == 0


def test_discounted_returns():
    m = mask_from([[0, 1, 1, 1]])
    r = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    out = discounted_returns(r, m, discount=0.5)
    # G3 = 2 ; G2 = 0 + .5*2 = 1 ; G1 = 1 + .5*1 = 1.5
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.5, 1.0, 2.0]]))


# ---------------------------------------------------------------------------------------
# the whole pipeline
# ---------------------------------------------------------------------------------------


def _batch(rewards, mask, **extra):
    b = {"rewards": torch.tensor(rewards), "loss_mask": mask_from(mask)}
    b.update(extra)
    return b


MASK4 = [[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 0], [0, 1, 1, 1]]
NO_NORM = NormConfig(mean_level="none", std_level="none")


def actor_cfg(adv_estimator: Any = "grpo", **options: Any) -> ActorConfig:
    """The actor section as load_config gives it: the estimator's default norms unless set."""
    reward_norm, adv_norm = default_norms(adv_estimator)
    options.setdefault("reward_norm", reward_norm)
    options.setdefault("adv_norm", adv_norm)
    return ActorConfig(adv_estimator=adv_estimator, **options)


def advantages(batch, group_size=1, **options):
    """compute_advantages with an actor section of these options, checked as the trainer does at start."""
    actor = actor_cfg(**options)
    check_advantage_options(actor, group_size=group_size)
    return compute_advantages(batch, actor, group_size=group_size)


def test_grpo_broadcasts_group_normalised_rewards():
    out = advantages(_batch([1.0, 0.0, 1.0, 1.0], MASK4), adv_estimator="grpo", group_size=2)
    a = 0.5 / (math.sqrt(0.5) + EPS)  # group {1, 0}: mean .5, unbiased std sqrt(.5)
    expected = torch.tensor([[0, a, a, 0], [0, -a, -a, -a], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    torch.testing.assert_close(out["advantages"], expected)
    torch.testing.assert_close(out["rewards"], torch.tensor([a, -a, 0.0, 0.0]))


def test_dr_grpo_rloo_and_no_eos_mask():
    batch = _batch([1.0, 0.0, 3.0, 1.0], MASK4, seq_no_eos_mask=torch.tensor([False, True, False, False]))
    dr = advantages(batch, group_size=2, reward_norm=NormConfig(std_level="none"))
    torch.testing.assert_close(dr["rewards"], torch.tensor([0.5, -0.5, 1.0, -1.0]))
    rloo = advantages(batch, adv_estimator="rloo", group_size=2)
    # Leave-one-out baseline in a group of two is the other sample's reward.
    torch.testing.assert_close(rloo["rewards"], torch.tensor([1.0, -1.0, 2.0, -2.0]))
    masked = advantages(batch, adv_estimator="rloo", group_size=2, mask_no_eos_with_zero=True)
    torch.testing.assert_close(masked["rewards"], torch.tensor([1.0, 0.0, 2.0, -2.0]))
    assert masked["advantages"][1].abs().sum() == 0
    torch.testing.assert_close(masked["advantages"][3], torch.tensor([0.0, -2.0, -2.0, -2.0]))


def test_grpo_with_kl_penalty_adds_reward_to_go():
    mask = [[0, 1, 1, 1], [0, 1, 1, 1]]
    logp = torch.tensor([[0.0, -1.0, -1.0, -1.0], [0.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, -2.0], [0.0, -1.0, -1.0, -1.0]])
    batch = _batch([1.0, 0.0], mask, old_logprobs=logp, ref_logprobs=ref)
    out = advantages(batch, group_size=2, kl_ctl=0.1, kl_estimator="k1")
    a = 0.5 / (math.sqrt(0.5) + EPS)
    # k1 = logp - ref on row 0: [.5, 0, 1]; rewards -0.1*k1 = [-.05, 0, -.1]; reward-to-go from the end.
    expected0 = [0.0, a - 0.05 - 0.0 - 0.1, a - 0.1, a - 0.1]
    torch.testing.assert_close(out["advantages"][0], torch.tensor(expected0))
    torch.testing.assert_close(out["advantages"][1], torch.tensor([0.0, -a, -a, -a]))


def test_reinforce_pp_batch_normalised_returns():
    mask = [[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 1, 1]]
    logp = torch.zeros(3, 4)
    ref = torch.tensor([[0.0, -0.2, 0.1, 0.0], [0.0, 0.0, 0.3, -0.1], [0.0, 0.5, 0.0, 0.2]])
    batch = _batch([1.0, 0.0, 2.0], mask, old_logprobs=logp, ref_logprobs=ref)
    out = advantages(batch, adv_estimator="reinforce++", kl_ctl=0.2, kl_estimator="k3", discount=0.9)
    rewards = [1.0, 0.0, 2.0]
    returns = [[0.0] * 4 for _ in range(3)]
    for b in range(3):
        pos = [s for s in range(4) if mask[b][s]]
        g = 0.0
        for s in reversed(pos):
            r = ref[b, s].item() - logp[b, s].item()
            k3 = math.exp(r) - r - 1
            g = -0.2 * k3 + (rewards[b] if s == pos[-1] else 0.0) + 0.9 * g
            returns[b][s] = g
    flat = [returns[b][s] for b in range(3) for s in range(4) if mask[b][s]]
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    expected = [[(returns[b][s] - mean) / (std + EPS) if mask[b][s] else 0.0 for s in range(4)] for b in range(3)]
    torch.testing.assert_close(out["advantages"], torch.tensor(expected))
    torch.testing.assert_close(out["returns"], torch.tensor(returns))


def test_gae_pipeline_with_adv_norm():
    mask = [[0, 1, 1], [0, 0, 1]]
    values = torch.tensor([[0.0, 0.5, 0.25], [0.0, 0.0, 1.0]])
    batch = _batch(
        [1.0, 3.0],
        mask,
        values=values,
        seq_no_eos_mask=torch.tensor([False, False]),
        values_after=torch.tensor([9.0, 9.0]),
    )  # ended with EOS: values_after is not used
    # The defaults of 'gae' are standard PPO's: raw rewards, batch-whitened advantages.
    cfg = actor_cfg(adv_estimator="gae", discount=1.0, gae_lambda=1.0)
    assert cfg.reward_norm.is_identity and cfg.adv_norm == NormConfig(mean_level="batch", std_level="batch")
    out = compute_advantages(batch, cfg, group_size=1)
    # lambda = gamma = 1: A_t = (sum of future rewards) - V_t -> row0: [1 - .5, 1 - .25], row1: [3 - 1]
    raw = [0.5, 0.75, 2.0]
    torch.testing.assert_close(out["returns"], torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 3.0]]))
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    n = [(x - mean) / (std + EPS) for x in raw]
    torch.testing.assert_close(out["advantages"], torch.tensor([[0.0, n[0], n[1]], [0.0, 0.0, n[2]]]))


def test_pipeline_errors_are_clear():
    with pytest.raises(ValueError, match="critic 'values'"):
        advantages(_batch([1.0], [[0, 1]], seq_no_eos_mask=torch.tensor([True])), adv_estimator="gae")
    with pytest.raises(ValueError, match="values_after"):
        advantages(
            _batch([1.0], [[0, 1]], seq_no_eos_mask=torch.tensor([True]), values=torch.zeros(1, 2)), adv_estimator="gae"
        )
    with pytest.raises(ValueError, match="ref_logprobs"):
        advantages(_batch([1.0], [[0, 1]]), kl_ctl=0.1, reward_norm=NO_NORM)
    with pytest.raises(ValueError, match="adv_estimator"):
        check_advantage_options(ActorConfig(adv_estimator=cast(Any, "ppo")), group_size=1)


def test_compute_advantages_reads_the_actor_section():
    actor = ActorConfig(group_size=4, adv_estimator="rloo", kl_ctl=0.2, discount=0.9)
    assert actor.reward_norm == NormConfig(mean_level="group", std_level="group", group_size=0)
    assert actor.adv_norm.is_identity  # both levels 'none' in the config: no normalisation
    batch = _batch([1.0, 0.0, 3.0, 1.0], MASK4)
    # kl_ctl comes from the section unless the trainer passes its controller's current value.
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_advantages(batch, actor, group_size=2)
    out = compute_advantages(batch, actor, group_size=2, kl_ctl=0.0)
    torch.testing.assert_close(out["rewards"], torch.tensor([1.0, -1.0, 2.0, -2.0]))
    # max_new_tokens, the generation budget, is passed in: the overlong penalty needs it.
    long = dataclasses.replace(actor, overlong_reward_penalty=True, overlong_tokens=2)
    penalised = compute_advantages(batch, long, group_size=2, max_new_tokens=3, kl_ctl=0.0)
    # Lengths 2, 3, 1, 3 with the window [1, 3]: penalties -0.5, -1, 0, -1, so rewards 0.5, -1, 3, 0
    # before the leave-one-out baseline (the other sample of the pair).
    torch.testing.assert_close(penalised["rewards"], torch.tensor([1.5, -1.5, 3.0, -3.0]))


# ---------------------------------------------------------------------------------------
# defaults that must not silently learn nothing; truncated responses
# ---------------------------------------------------------------------------------------


def test_group_normalisation_of_groups_of_one_is_rejected():
    with pytest.raises(ValueError, match="one sample.*n_samples > 1"):
        check_advantage_options(actor_cfg(adv_estimator="grpo"), group_size=1)
    with pytest.raises(ValueError, match="reward_norm"):
        check_advantage_options(
            actor_cfg(reward_norm=NormConfig(mean_level="batch", std_level="group", group_size=1)), group_size=4
        )
    with pytest.raises(ValueError, match="adv_norm"):
        check_advantage_options(
            actor_cfg(adv_estimator="rloo", adv_norm=NormConfig(mean_level="group", std_level="none")), group_size=1
        )
    # Batch-level statistics, no normalisation, and estimators that do not use reward_norm are fine.
    check_advantage_options(actor_cfg(reward_norm=NormConfig(mean_level="batch", std_level="batch")), group_size=1)
    check_advantage_options(actor_cfg(reward_norm=NO_NORM), group_size=1)
    check_advantage_options(actor_cfg(adv_estimator="gae"), group_size=1)
    check_advantage_options(actor_cfg(adv_estimator="reinforce++"), group_size=1)


def test_estimator_default_normalisation():
    grpo_reward, grpo_adv = default_norms("grpo")
    assert grpo_reward == NormConfig() and grpo_adv.is_identity
    # The schema's defaults are GRPO's.
    assert (ActorConfig().reward_norm, ActorConfig().adv_norm) == (grpo_reward, grpo_adv)
    gae_reward, gae_adv = default_norms("gae")
    assert gae_reward.is_identity and gae_adv == NormConfig(mean_level="batch", std_level="batch")
    # RLOO has its own baseline: reward_norm is not applied.
    batch = _batch([1.0, 0.0, 3.0, 1.0], MASK4)
    with_norm = advantages(batch, adv_estimator="rloo", group_size=2, reward_norm=NormConfig())
    torch.testing.assert_close(with_norm["rewards"], advantages(batch, adv_estimator="rloo", group_size=2)["rewards"])
    torch.testing.assert_close(with_norm["rewards"], torch.tensor([1.0, -1.0, 2.0, -2.0]))


def test_gae_bootstraps_a_truncated_response_from_the_value_after_it():
    # Two rows with the same tokens: row 0 ended with EOS, row 1 was cut off.  Values are the
    # critic's values of the state before each token; values_after the state after the last one.
    m = mask_from([[0, 1, 1, 1], [0, 1, 1, 1]])
    values = torch.tensor([[9.0, 0.5, 0.2, -0.3], [9.0, 0.5, 0.2, -0.3]])
    batch = _batch(
        [1.0, 1.0],
        [[0, 1, 1, 1]] * 2,
        values=values,
        values_after=torch.tensor([4.0, 0.8]),
        seq_no_eos_mask=torch.tensor([False, True]),
    )
    cfg = actor_cfg(adv_estimator="gae", discount=0.9, gae_lambda=0.5, adv_norm=NO_NORM)
    out = compute_advantages(batch, cfg, group_size=2)
    # EOS row: V_end = 0.     t3: d = 1 - (-.3) = 1.3                       A3 = 1.3
    #                         t2: d = .9 * -.3 - .2 = -.47                  A2 = -.47 + .45 * 1.3 = .115
    #                         t1: d = .9 * .2 - .5 = -.32                   A1 = -.32 + .45 * .115 = -.26825
    # Truncated row: V_end = .8.  t3: d = 1 + .9 * .8 + .3 = 2.02           A3 = 2.02
    #                         t2: A2 = -.47 + .45 * 2.02 = .439
    #                         t1: A1 = -.32 + .45 * .439 = -.12245
    torch.testing.assert_close(
        out["advantages"], torch.tensor([[0.0, -0.26825, 0.115, 1.3], [0.0, -0.12245, 0.439, 2.02]])
    )
    torch.testing.assert_close(out["returns"], torch.tensor([[0.0, 0.23175, 0.315, 1.0], [0.0, 0.37755, 0.639, 1.72]]))
    # Values taken one position late (the value after each token instead of before it) change every
    # advantage: the alignment is what the numbers above check.
    shifted = dict(batch, values=torch.tensor([[9.0, 0.2, -0.3, 0.8], [9.0, 0.2, -0.3, 0.8]]))
    assert not torch.allclose(compute_advantages(shifted, cfg, group_size=2)["advantages"], out["advantages"])
    # verl's convention (bootstrap_truncated = False) ends the truncated row like the EOS row.
    ended = compute_advantages(batch, dataclasses.replace(cfg, bootstrap_truncated=False), group_size=2)
    torch.testing.assert_close(ended["advantages"][1], out["advantages"][0])
    # gae_advantages on its own against the plain-Python reference with a bootstrap value.
    adv, _ = gae_advantages(
        torch.tensor([[0.0, 0.0, 0.0, 1.0]]),
        values[:1],
        m[:1],
        discount=0.9,
        gae_lambda=0.5,
        end_values=torch.tensor([0.8]),
    )
    torch.testing.assert_close(adv, out["advantages"][1:])


def test_overlong_filtering_and_mask_no_eos_with_zero():
    mask = [[0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 1, 1]]
    batch = _batch([1.0, 0.0, 1.0, 1.0], mask, seq_no_eos_mask=torch.tensor([False, False, True, False]))
    norm = NormConfig(mean_level="batch", std_level="batch")
    # mask_no_eos_with_zero (AReaL): the truncated row keeps training with a 0 reward, which batch
    # whitening turns into a negative advantage when the batch mean is positive.
    zeroed = advantages(batch, adv_estimator="reinforce++", mask_no_eos_with_zero=True)
    assert zeroed["rewards"][2] == 0 and (zeroed["advantages"][2, 1:] < 0).all()
    # Overlong filtering: the truncated row gets advantage 0 and takes no part in the statistics.
    filt = advantages(
        batch, adv_estimator="grpo", group_size=2, reward_norm=NO_NORM, adv_norm=norm, overlong_filtering=True
    )
    kept = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # the loss tokens of rows 0, 1 and 3
    mean, std = statistics.mean(kept), statistics.stdev(kept)
    expected = torch.tensor(
        [[0.0] + [(x - mean) / (std + EPS)] * 2 for x in (1.0, 0.0)]
        + [[0.0, 0.0, 0.0]]
        + [[0.0] + [(1.0 - mean) / (std + EPS)] * 2]
    )
    torch.testing.assert_close(filt["advantages"], expected)


def test_penalty_kl_is_returned_for_the_kl_controller():
    mask = [[0, 1, 1], [0, 1, 0]]
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0], [0.0, -1.0, 7.0]])
    out = advantages(
        _batch([1.0, 0.0], mask, old_logprobs=logp, ref_logprobs=ref), group_size=2, kl_ctl=0.1, kl_estimator="k1"
    )
    torch.testing.assert_close(out["kl"], torch.tensor([[0.0, 0.5, -1.0], [0.0, 0.5, 0.0]]))


def test_gae_credits_agent_turns_where_they_ended():
    # Loss ids at 1, 2 (turn 1, reward 1 on id 2) and 4, 5 (turn 2, reward 2 on id 5); values 0, gamma 0.5, lambda 1.
    mask = [[0, 1, 1, 0, 1, 1]]
    turns = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 2.0]])
    batch = _batch(
        [3.0], mask, values=torch.zeros(1, 6), seq_no_eos_mask=torch.tensor([False]), **{TURN_REWARDS: turns}
    )
    cfg = actor_cfg(adv_estimator="gae", discount=0.5, gae_lambda=1.0, adv_norm=NO_NORM, bootstrap_truncated=False)
    out = compute_advantages(batch, cfg, group_size=1)
    # Hand-computed discounted returns over the loss ids: 2; 0 + .5 * 2 = 1; 1 + .5 * 1 = 1.5; .5 * 1.5 = .75.
    torch.testing.assert_close(out["advantages"], torch.tensor([[0.0, 0.75, 1.5, 0.0, 1.0, 2.0]]))
    assert float(out["token_rewards"].sum()) == 3.0  # the episode's reward, moved, not added
    # The group baselines compare whole episodes: GRPO's advantages are the same with or without turn rewards.
    grpo = actor_cfg(adv_estimator="grpo", adv_norm=NO_NORM)
    two = _batch([3.0, 1.0], [[0, 1, 1, 0, 1, 1]] * 2)
    with_turns = compute_advantages({**two, TURN_REWARDS: torch.cat([turns, turns / 3])}, grpo, group_size=2)
    torch.testing.assert_close(with_turns["advantages"], compute_advantages(two, grpo, group_size=2)["advantages"])
