"""KL estimators (values, clamping, gradients) and the adaptive KL controller against hand-computed numbers."""

import math
from typing import cast

import pytest
import torch

from archon.rl.kl import KL_LOSS_TYPES, KLController, kl_estimate


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    # r = ref - logp = [-1, 1]
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1]))
    assert kl_estimate(torch.tensor([0.3]), torch.tensor([0.3]), "k3").item() == 0.0


def test_kl_clamping_prevents_overflow():
    logp, ref = torch.tensor([0.0, -120.0]), torch.tensor([-120.0, 0.0])
    raw = kl_estimate(logp, ref, "k3", log_ratio_clamp=None, value_clamp=None)
    assert torch.isinf(raw[1])  # exp(120) overflows float32
    ratio_only = kl_estimate(logp, ref, "k3", value_clamp=None)
    torch.testing.assert_close(ratio_only, torch.tensor([math.exp(-20) + 20 - 1, math.exp(20) - 20 - 1]))
    both = kl_estimate(logp, ref, "k3")
    torch.testing.assert_close(both, torch.tensor([10.0, 10.0]))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(logp, ref, "k4")


def test_kl_aliases_and_straight_through_values():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-2.0, -1.0, -0.4])
    for alias, name in (
        ("kl", "k1"),
        ("mse", "k2"),
        ("low_var_kl", "k3"),
        ("kl+", "k1"),
        ("low_var_kl+", "k3"),
        ("k1+", "k1"),
        ("k3+", "k3"),
    ):
        torch.testing.assert_close(kl_estimate(logp, ref, alias), kl_estimate(logp, ref, name))


def _softmax_case():
    """A 5-token softmax policy with logits ``z`` (float64) and a fixed reference distribution."""
    z = torch.tensor([0.3, -1.2, 0.8, 0.1, -0.4], dtype=torch.float64, requires_grad=True)
    ref_logp = torch.log_softmax(torch.tensor([-0.5, 0.4, 0.2, -1.0, 0.9], dtype=torch.float64), -1)
    return z, ref_logp


def _expected_estimator_gradient(estimator: str) -> torch.Tensor:
    """E_{y ~ pi}[grad_z estimator(log pi(y), log ref(y))], by exact enumeration of the vocabulary."""
    z, ref_logp = _softmax_case()
    logp = torch.log_softmax(z, -1)
    probs = logp.exp().detach()
    total = cast(
        torch.Tensor,
        sum(
            probs[y] * kl_estimate(logp[y], ref_logp[y], estimator, log_ratio_clamp=None, value_clamp=None)
            for y in range(5)
        ),
    )
    (grad,) = torch.autograd.grad(total, z)
    return grad


@pytest.mark.parametrize("estimator", KL_LOSS_TYPES)
def test_kl_loss_gradients_match_the_kl_they_claim(estimator: str):
    z, ref_logp = _softmax_case()
    p = torch.softmax(z.detach(), -1)
    logp = p.log()
    # Analytic gradients w.r.t. the logits: d KL(pi||ref)/dz_j = p_j (log p_j - log ref_j - KL(pi||ref));
    # d KL(ref||pi)/dz_j = p_j - ref_j.
    forward_kl = (p * (logp - ref_logp)).sum()
    grad_forward = p * (logp - ref_logp - forward_kl)
    grad_reverse = p - ref_logp.exp()
    claims = {
        "k1": torch.zeros(5, dtype=torch.float64),
        "k2": grad_forward,
        "k3": grad_reverse,
        "k1+": grad_forward,
        "k3+": grad_forward,
    }
    aliases = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "low_var_kl+": "k3+"}
    claim = claims[aliases.get(estimator, estimator)]
    assert grad_forward.abs().max() > 0.05 and (grad_forward - grad_reverse).abs().max() > 0.05  # a real test
    torch.testing.assert_close(_expected_estimator_gradient(estimator), claim, atol=1e-12, rtol=1e-9)


def test_adaptive_kl_controller_follows_verl_rule_and_round_trips():
    ctl = KLController(0.2, "adaptive", target=0.1, horizon=1000)
    ctl.update(0.15, n_samples=100)  # error 0.5 is clipped to 0.2: coef *= 1 + 0.2 * 100 / 1000
    assert ctl.value == pytest.approx(0.2 * 1.02)
    ctl.update(0.09, n_samples=50)  # error -0.1: coef *= 1 - 0.1 * 50 / 1000
    assert ctl.value == pytest.approx(0.2 * 1.02 * 0.995)
    other = KLController(0.2, "adaptive", target=0.1, horizon=1000)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value
    fixed = KLController(0.2)
    fixed.update(5.0, 100)
    assert fixed.value == 0.2
    with pytest.raises(ValueError, match="horizon"):
        KLController(0.2, "adaptive", target=0.1, horizon=0)
