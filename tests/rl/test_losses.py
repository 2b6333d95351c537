"""PPO actor and critic losses and their aggregation against hand-computed numbers."""

import math
from typing import Any, cast

import pytest
import torch

from archon.rl.losses import aggregate, loss_weight, make_actor_loss_fn, ppo_actor_loss, ppo_critic_loss
from archon.rl.rejection_sampling import RejectionSampling
from parallel.loss_parallel import vocab_parallel_logprobs_entropy


def row(values):
    return torch.tensor([values], dtype=torch.float32)


def logs(ratios):
    return torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# aggregation and weights
# ---------------------------------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode,expected,weight",
    [
        ("token-mean", (2 + 3 + 4 + 5) / 4, 4.0),
        ("seq-mean-token-sum", (5 + 9) / 2, 2.0),
        ("seq-mean-token-mean", (2.5 + 4.5) / 2, 2.0),
        ("seq-mean-token-sum-norm", (5 / 10 + 9 / 10) / 2, 2.0),
    ],
)
def test_aggregate_modes_by_hand(mode, expected, weight):
    assert aggregate(PER_TOKEN, MASK, mode, max_response_len=10).item() == pytest.approx(expected)
    assert loss_weight({"loss_mask": MASK}, mode) == weight


def test_aggregate_errors_and_empty():
    with pytest.raises(ValueError, match="max_response_len"):
        aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(PER_TOKEN, MASK, "sum")
    x = torch.ones(2, 3, requires_grad=True)
    out = aggregate(x, torch.zeros(2, 3), "token-mean")
    out.backward()  # an all-masked microbatch still has a graph
    assert out.item() == 0.0 and x.grad is not None and x.grad.abs().sum() == 0


# ---------------------------------------------------------------------------------------
# PPO policy loss
# ---------------------------------------------------------------------------------------


def test_clip_both_sides_and_gradient():
    ratios = [1.5, 0.5, 1.1, 0.7, 1.5]
    adv = row([1.0, 1.0, -1.0, -1.0, -1.0])
    old = torch.zeros(1, 5)
    logp = logs(ratios).requires_grad_()
    loss, stats = ppo_actor_loss(logp, old, adv, torch.ones(1, 5), eps_clip=0.2)
    # per token: max(-A r, -A clip(r, .8, 1.2))
    #  r=1.5 A=+1: max(-1.5, -1.2) = -1.2 (clipped) | r=0.5 A=+1: max(-.5, -.8) = -.5
    #  r=1.1 A=-1: 1.1                              | r=0.7 A=-1: max(.7, .8) = .8 (clipped)
    #  r=1.5 A=-1: max(1.5, 1.2) = 1.5
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8 + 1.5) / 5)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)
    assert stats["ratio_mean"].item() == pytest.approx(sum(ratios) / 5)
    assert stats["approx_kl"].item() == pytest.approx(sum(0.5 * math.log(r) ** 2 for r in ratios) / 5)
    loss.backward()
    # d/dlogp (-A r) = -A r where the unclipped branch is active, 0 where clipped.
    torch.testing.assert_close(logp.grad, row([0.0, -0.5 / 5, 1.1 / 5, 0.0, 1.5 / 5]))


def test_clip_higher():
    logp = logs([1.5, 0.7])
    loss, stats = ppo_actor_loss(
        logp, torch.zeros(1, 2), row([1.0, -1.0]), torch.ones(1, 2), eps_clip=0.2, eps_clip_higher=0.6
    )
    # upper bound 1.6: r=1.5 is inside -> -1.5 ; lower bound still .8: r=.7 A<0 -> .8
    assert loss.item() == pytest.approx((-1.5 + 0.8) / 2)
    assert stats["clip_frac"].item() == pytest.approx(0.5)


def test_dual_clip_only_for_negative_advantages():
    logp = logs([4.0, 4.0, 2.0]).requires_grad_()
    adv = row([-1.0, 1.0, -1.0])
    loss, stats = ppo_actor_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), eps_clip=0.2, c_clip=3.0)
    # r=4 A=-1: max(4, 1.2) = 4 -> capped at c=3 | r=4 A=+1: -1.2 (normal clip) | r=2 A=-1: 2 < 3 kept
    assert loss.item() == pytest.approx((3.0 - 1.2 + 2.0) / 3)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, row([0.0, 0.0, 2.0 / 3]))
    with pytest.raises(ValueError, match="greater than 1"):
        ppo_actor_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), eps_clip=0.2, c_clip=0.5)


def test_masking_ignores_padding_even_if_it_is_inf():
    logp = torch.tensor([[float("-inf"), math.log(1.5), 0.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 5.0]])
    adv = torch.tensor([[100.0, 1.0, -2.0, float("nan")]])
    mask = torch.tensor([[0, 1, 1, 0]])
    loss, stats = ppo_actor_loss(logp, old, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx((-1.2 + 2.0) / 2)
    loss.backward()
    assert logp.grad is not None
    assert torch.isfinite(logp.grad).all()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    logp.grad = None
    ref = torch.tensor([[float("nan"), math.log(1.5), 0.0, 3.0]])  # kl 0 on both loss tokens
    loss, stats = ppo_actor_loss(logp, old, adv, mask, eps_clip=0.2, ref_logprobs=ref, kl_loss_coef=1.0)
    assert loss.item() == pytest.approx((-1.2 + 2.0) / 2) and stats["kl_loss"].item() == 0.0
    loss.backward()
    assert logp.grad is not None
    assert torch.isfinite(logp.grad).all()


def test_gspo_sequence_ratio():
    # Row 0: token log-ratios .1 .2 .3 -> s = exp(.2) ; row 1: .5 .5 -> s = exp(.5) = 1.65 > 1.3 (clipped).
    logp = torch.tensor([[0.0, 0.1, 0.2, 0.3], [0.0, 0.5, 0.5, 0.0]], requires_grad=True)
    old = torch.zeros(2, 4)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    adv = torch.ones(2, 4)
    s0 = math.exp(0.2)
    loss, stats = ppo_actor_loss(logp, old, adv, mask, eps_clip=0.3, importance_sampling_level="sequence")
    assert loss.item() == pytest.approx((-3 * s0 - 2 * 1.3) / 5, rel=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)
    assert stats["ratio_mean"].item() == pytest.approx((3 * s0 + 2 * math.exp(0.5)) / 5, rel=1e-6)
    loss.backward()
    # The gradient of every token of row 0 is -A * s / N (GSPO-token); row 1 is clipped.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -s0 / 5, -s0 / 5, -s0 / 5], [0.0, 0.0, 0.0, 0.0]]))
    seq_loss, _ = ppo_actor_loss(
        logp.detach(),
        old,
        adv,
        mask,
        eps_clip=0.3,
        importance_sampling_level="sequence",
        agg_mode="seq-mean-token-mean",
    )
    assert seq_loss.item() == pytest.approx((-s0 - 1.3) / 2, rel=1e-6)


def _gspo_case():
    torch.manual_seed(3)
    logp = (torch.randn(3, 6) * 0.05).requires_grad_()  # ratios near 1: no clipping
    old = torch.zeros(3, 6)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]])
    adv = torch.randn(3, 6)  # token advantages that differ within a sequence (GAE-like)
    return logp, old, mask, adv


def test_gspo_averages_advantages_per_sequence_and_matches_the_paper_under_seq_mean_token_mean():
    logp, old, mask, adv = _gspo_case()
    loss, stats = ppo_actor_loss(
        logp, old, adv, mask, eps_clip=0.2, importance_sampling_level="sequence", agg_mode="seq-mean-token-mean"
    )
    loss.backward()
    # GSPO (Zheng et al. 2025): J = 1/G sum_i s_i * Abar_i with s_i = exp(mean_t log ratio) and Abar_i
    # the sequence's mean advantage (AReaL's choice for token advantages); its gradient, here by autograd.
    m = mask.bool()
    x = logp.detach().clone().requires_grad_()
    objective = 0.0
    for i in range(3):
        s_i = torch.exp((x[i] - old[i])[m[i]].mean())
        objective = objective + s_i * adv[i][m[i]].mean()
    cast(torch.Tensor, -objective / 3).backward()
    torch.testing.assert_close(logp.grad, x.grad)
    abar = [adv[i][m[i]].mean().item() for i in range(3)]
    assert stats["advantages_mean"].item() == pytest.approx(sum(abar) / 3, rel=1e-5)


def test_gspo_under_token_mean_is_arealss_length_weighted_form():
    logp, old, mask, adv = _gspo_case()
    loss, _ = ppo_actor_loss(logp, old, adv, mask, eps_clip=0.2, importance_sampling_level="sequence")
    loss.backward()
    # AReaL: every token carries the sequence ratio (gradient through all its tokens) and the
    # sequence's mean advantage, then a token mean.
    m = mask.bool()
    x = logp.detach().clone().requires_grad_()
    total = 0.0
    for i in range(3):
        s_i = torch.exp((x[i] - old[i])[m[i]].mean())
        total = total + m[i].sum() * -(s_i * adv[i][m[i]].mean())
    (total / m.sum()).backward()
    torch.testing.assert_close(logp.grad, x.grad)


def _rs(**kw) -> RejectionSampling:
    return RejectionSampling(**{"upper": 3.0, **kw})


def test_rejection_sampling_token_mask_clamp_lower_and_none():
    prox = torch.zeros(1, 3)
    logp = torch.zeros(1, 3)  # ratio to the proximal policy is 1: only the behaviour weight matters
    behav = -logs([0.5, 2.0, 4.0])  # w = exp(prox - behav) = .5, 2, 4
    adv = row([1.0, 1.0, -1.0])
    mask = torch.ones(1, 3)

    def run(rs):
        return ppo_actor_loss(logp, prox, adv, mask, eps_clip=0.2, behav_logprobs=behav, rejection_sampling=rs)

    loss, stats = run(_rs())  # AReaL's default action: the token above the bound is dropped
    assert loss.item() == pytest.approx((-0.5 - 2.0 + 0.0) / 3)  # it still counts in the denominator
    assert stats["behav_imp_weight"].item() == pytest.approx((0.5 + 2) / 3)
    assert stats["behav_filtered_frac"].item() == pytest.approx(1 / 3)
    loss, stats = run(_rs(action="clamp"))
    assert loss.item() == pytest.approx((-0.5 - 2.0 + 3.0) / 3)
    assert stats["behav_filtered_frac"].item() == pytest.approx(1 / 3)
    loss, _ = run(_rs(lower=0.6))
    assert loss.item() == pytest.approx((0.0 - 2.0 + 0.0) / 3)
    loss, _ = run(_rs(action="clamp", lower=0.6))
    assert loss.item() == pytest.approx((-0.6 - 2.0 + 3.0) / 3)
    loss, stats = run(None)  # no rejection sampling: no behaviour correction at all (AReaL)
    assert loss.item() == pytest.approx((-1.0 - 1.0 + 1.0) / 3) and stats["behav_imp_weight"].item() == 1.0


def test_decoupled_weight_multiplies_clipped_surrogate():
    logp = logs([1.5]).requires_grad_()
    prox = torch.zeros(1, 1)
    behav = -logs([2.0])
    kw: dict[str, Any] = dict(eps_clip=0.2, behav_logprobs=behav, rejection_sampling=_rs())
    loss, _ = ppo_actor_loss(logp, prox, row([1.0]), torch.ones(1, 1), **kw)
    assert loss.item() == pytest.approx(2.0 * -1.2)  # w * max(-1.5, -1.2)
    logp2 = logs([0.9]).requires_grad_()
    loss2, _ = ppo_actor_loss(logp2, prox, row([1.0]), torch.ones(1, 1), **kw)
    loss2.backward()
    assert logp2.grad is not None and logp2.grad.item() == pytest.approx(
        -2.0 * 0.9
    )  # unclipped: d(-w r A)/dlogp = -w r A


def test_rejection_sampling_sequence_level():
    logp = torch.zeros(2, 3)
    prox = torch.zeros(2, 3)
    # Row 0: w = .5 and 2 -> geometric mean 1. Row 1: w = 4, 4 -> 4 (> 3: the whole row is judged out).
    behav = torch.stack([-logs([1.0, 0.5, 2.0])[0], -logs([1.0, 4.0, 4.0])[0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    adv = torch.ones(2, 3)

    def run(rs):
        return ppo_actor_loss(logp, prox, adv, mask, eps_clip=0.2, behav_logprobs=behav, rejection_sampling=rs)

    loss, stats = run(_rs(level="sequence"))
    # Every token of a kept row weighs the row's geometric mean (1); row 1 is dropped.
    assert loss.item() == pytest.approx((-1.0 - 1.0 + 0.0 + 0.0) / 4)
    assert stats["behav_filtered_frac"].item() == pytest.approx(0.5)
    trunc, _ = run(_rs(level="sequence", action="clamp"))
    assert trunc.item() == pytest.approx((-1.0 - 1.0 - 3.0 - 3.0) / 4)
    # agg 'max' judges a row by its largest ratio: 2 and 4, both above 1.5, so both rows are dropped,
    # while their geometric means (1 and 4) would keep row 0.
    loss_max, _ = run(_rs(level="sequence", agg="max", upper=1.5))
    assert loss_max.item() == pytest.approx(0.0)
    loss_mean, _ = run(_rs(level="sequence", upper=1.5))
    assert loss_mean.item() == pytest.approx(-2.0 / 4)
    # KL metric: k2 per token = 0.5 * log(w)^2; row 0 sums to log(2)^2, row 1 to log(4)^2 = 1.92.
    loss_kl, _ = run(_rs(level="sequence", metric="kl_k2", agg="sum", upper=1.0))
    # For KL metrics the weight stays per token (.5 and 2 in row 0); row 1 is dropped.
    assert loss_kl.item() == pytest.approx((-0.5 - 2.0) / 4)


def test_rejection_sampling_kl_metric_token_level_matches_areal_definition():
    # AReaL: metric kl_k3 of (log pi_prox, log pi_behav) = exp(r) - 1 - r with r = log pi_behav - log pi_prox.
    prox = torch.tensor([[-0.1, -1.0, -3.0]])
    behav = torch.tensor([[-0.2, -1.5, -1.0]])
    r = behav - prox  # -0.1, -0.5, 2
    k3 = torch.exp(r) - 1 - r  # 0.005, 0.107, 4.39
    mask = torch.ones(1, 3)
    loss, stats = ppo_actor_loss(
        prox.clone(),
        prox,
        torch.ones(1, 3),
        mask,
        eps_clip=0.2,
        behav_logprobs=behav,
        rejection_sampling=RejectionSampling(metric="kl_k3", upper=1.0),
    )
    keep = k3 <= 1.0
    w = torch.exp(prox - behav)
    assert loss.item() == pytest.approx(float(-(w * keep).sum() / 3), rel=1e-6)
    assert stats["behav_filtered_frac"].item() == pytest.approx(1 / 3)


def test_rejection_sampling_validation():
    with pytest.raises(ValueError, match="above 1"):
        RejectionSampling(upper=1.0)
    with pytest.raises(ValueError, match="needs metric 'ratio'"):
        RejectionSampling(action="clamp", metric="kl_k2", upper=1.0)
    with pytest.raises(ValueError, match="above upper"):
        RejectionSampling(upper=2.0, lower=3.0)


def test_entropy_bonus_and_kl_loss():
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    old = logp.clone()
    ref = torch.tensor([[0.0, -2.0, -1.0]])
    adv = row([0.0, 1.0, -1.0])
    mask = torch.tensor([[0, 1, 1]])
    entropy = row([9.0, 0.5, 1.5])
    loss, stats = ppo_actor_loss(
        logp,
        old,
        adv,
        mask,
        eps_clip=0.2,
        entropy=entropy,
        entropy_coef=0.1,
        ref_logprobs=ref,
        kl_loss_coef=0.5,
        kl_loss_type="k3",
    )
    pg = (-1.0 + 1.0) / 2
    k3 = [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1]  # r = ref - logp = -1, +1
    expected = pg - 0.1 * (0.5 + 1.5) / 2 + 0.5 * sum(k3) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["entropy"].item() == pytest.approx(1.0)
    assert stats["kl_loss"].item() == pytest.approx(sum(k3) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_actor_loss(logp, old, adv, mask, eps_clip=0.2, kl_loss_coef=0.5)


def test_entropy_bonus_gradient_is_the_analytic_entropy_gradient():
    # Logits of 2 rows x 3 positions over a 6-token vocabulary; the entropy comes from the same
    # function the engine uses, so this checks the bonus end to end: d(-c * mean H)/dz.
    torch.manual_seed(1)
    z = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (2, 3))
    logp, entropy = vocab_parallel_logprobs_entropy(z, targets)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    coef = 0.3
    loss, stats = ppo_actor_loss(
        logp, logp.detach(), torch.zeros(2, 3), mask, eps_clip=0.2, entropy=entropy, entropy_coef=coef
    )
    loss.backward()
    p = torch.softmax(z.detach(), -1)
    h = -(p * p.log()).sum(-1, keepdim=True)
    grad_h = -p * (p.log() + h)  # dH/dz_j = -p_j (log p_j + H)
    expected = -coef * grad_h * mask.unsqueeze(-1) / mask.sum()
    torch.testing.assert_close(z.grad, expected)
    assert stats["entropy"].item() == pytest.approx(float((h.squeeze(-1) * mask).sum() / mask.sum()))


def test_seq_mean_modes_in_actor_loss():
    logp = torch.zeros(2, 4)
    adv = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 4.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
    # ratio 1 -> per-token loss is -A
    cases = {
        "token-mean": -(1 + 2 + 3 + 4) / 4,
        "seq-mean-token-sum": -(6 + 4) / 2,
        "seq-mean-token-mean": -(2 + 4) / 2,
        "seq-mean-token-sum-norm": -(6 / 8 + 4 / 8) / 2,
    }
    for mode, expected in cases.items():
        loss, _ = ppo_actor_loss(logp, logp, adv, mask, eps_clip=0.2, agg_mode=mode, max_response_len=8)
        assert loss.item() == pytest.approx(expected), mode


def test_on_policy_ratio_is_one_and_gradient_is_policy_gradient():
    torch.manual_seed(0)
    vocab, hidden, B, S = 7, 5, 3, 6
    layer = torch.nn.Linear(hidden, vocab)
    x = torch.randn(B, S, hidden)
    tokens = torch.randint(0, vocab, (B, S))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]])
    adv = torch.randn(B, S)

    def logprobs():
        return torch.log_softmax(layer(x), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    old = logprobs().detach()
    logp = logprobs()
    logp.retain_grad()
    loss, stats = ppo_actor_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0)
    assert stats["ratio_mean"].item() == 1.0
    assert stats["clip_frac"].item() == 0.0 and stats["dual_clip_frac"].item() == 0.0
    loss.backward()
    n = mask.sum()
    torch.testing.assert_close(logp.grad, -adv * mask / n)
    grads = [cast(torch.Tensor, p.grad).clone() for p in layer.parameters()]
    layer.zero_grad()
    (-(adv * logprobs() * mask).sum() / n).backward()
    for g, p in zip(grads, layer.parameters()):
        torch.testing.assert_close(g, p.grad)


# ---------------------------------------------------------------------------------------
# critic
# ---------------------------------------------------------------------------------------


def test_critic_clipped_value_loss():
    values = row([1.0, 2.0, 3.0]).requires_grad_()
    old = row([1.0, 1.5, 3.5])
    returns = row([2.0, 1.0, 3.0])
    loss, stats = ppo_critic_loss(values, old, returns, torch.ones(1, 3), value_eps_clip=0.2)
    # t1: both errors 1 -> .5 | t2: v_clip 1.7: max(1, .49) -> .5 | t3: v_clip 3.3: max(0, .09) -> .045 (clipped)
    assert loss.item() == pytest.approx((0.5 + 0.5 + 0.045) / 3)
    assert stats["value_clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["values_mean"].item() == pytest.approx(2.0)
    loss.backward()
    torch.testing.assert_close(values.grad, row([-1.0 / 3, 1.0 / 3, 0.0]))
    unclipped, _ = ppo_critic_loss(values.detach(), old, returns, torch.ones(1, 3), value_eps_clip=None)
    assert unclipped.item() == pytest.approx((0.5 + 0.5 + 0.0) / 3)


def test_critic_huber_value_loss():
    values = row([0.0, 0.0, 0.0]).requires_grad_()
    returns = row([1.0, 3.0, -5.0])
    loss, _ = ppo_critic_loss(values, values.detach(), returns, torch.ones(1, 3), loss_fn_type="huber", huber_delta=2.0)
    # |d| = 1 < 2: 0.5 ; |d| = 3: 2 * (3 - 1) = 4 ; |d| = 5: 2 * (5 - 1) = 8
    assert loss.item() == pytest.approx((0.5 + 4.0 + 8.0) / 3)
    loss.backward()
    torch.testing.assert_close(values.grad, row([-1.0 / 3, -2.0 / 3, 2.0 / 3]))
    # With the value clip, the larger of the clipped and unclipped Huber losses wins.
    old = row([0.0, 2.5, 0.0])
    clipped, stats = ppo_critic_loss(
        values.detach(), old, returns, torch.ones(1, 3), value_eps_clip=0.5, loss_fn_type="huber", huber_delta=2.0
    )
    # token 2: v_clip = 2.0 -> |d| = 1 -> 0.5 < 4: unclipped wins; others unchanged.
    assert clipped.item() == pytest.approx((0.5 + 4.0 + 8.0) / 3)
    old = row([0.0, -0.5, 0.0])
    clipped, stats = ppo_critic_loss(
        values.detach(), old, returns, torch.ones(1, 3), value_eps_clip=0.2, loss_fn_type="huber", huber_delta=2.0
    )
    # token 2: v_clip = -0.3 -> |d| = 3.3 -> 2 * 2.3 = 4.6 > 4
    assert clipped.item() == pytest.approx((0.5 + 4.6 + 8.0) / 3)
    assert stats["value_clip_frac"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="mse' or 'huber"):
        ppo_critic_loss(values, old, returns, torch.ones(1, 3), loss_fn_type="l1")


def test_make_actor_loss_fn_reads_batch_keys():
    logp = logs([1.5, 0.5])
    mb = {
        "loss_mask": torch.ones(1, 2),
        "advantages": row([1.0, 1.0]),
        "logprobs": -logs([2.0, 2.0]),
        "old_logprobs": torch.zeros(1, 2),
    }
    plain = make_actor_loss_fn(eps_clip=0.2)({"logprobs": logp}, mb)[0]
    assert plain.item() == pytest.approx((-1.2 - 0.5) / 2)  # old_logprobs is the proximal policy
    decoupled = make_actor_loss_fn(eps_clip=0.2, use_decoupled_loss=True, rejection_sampling=RejectionSampling())(
        {"logprobs": logp}, mb
    )[0]
    assert decoupled.item() == pytest.approx(2.0 * (-1.2 - 0.5) / 2)  # mb['logprobs'] is the behaviour policy
    with pytest.raises(ValueError, match="max_response_len"):
        make_actor_loss_fn(eps_clip=0.2, agg_mode="seq-mean-token-sum-norm")
