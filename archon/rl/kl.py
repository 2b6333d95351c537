"""Per-token estimators of KL(pi || pi_ref) from log-probabilities of sampled tokens, and the
controller of the KL penalty's coefficient.

The tokens were sampled from (approximately) ``pi``, so with ``r = ref_logp - logp``
(the log of ``pi_ref / pi`` at the sampled token) the classic estimators are
(Schulman, "Approximating KL Divergence"):

- ``k1 = -r = logp - ref_logp``: unbiased, high variance, can be negative;
- ``k2 = r**2 / 2``: biased, low variance, non-negative;
- ``k3 = exp(r) - r - 1``: unbiased, low variance, non-negative.

As values (the KL penalty inside the reward, logged KL) all three estimate KL(pi || pi_ref).
As losses they differ: the gradient flows only through ``logp`` of the sampled tokens, and
in expectation over ``y ~ pi``

- ``k1``'s gradient is ``E[grad logp] = 0``: it adds only noise;
- ``k2``'s gradient is ``E[(logp - ref_logp) grad logp]``, exactly grad KL(pi || pi_ref);
- ``k3``'s gradient is ``E[(1 - pi_ref/pi) grad logp] = -sum_y pi_ref(y) grad logp(y)``,
  exactly grad KL(pi_ref || pi), the reverse KL (still zero only at pi = pi_ref).

``k1+`` and ``k3+`` (verl's straight-through variants) have the value of ``k1``/``k3`` and the
gradient of ``k2``.  verl's names are accepted as aliases: ``kl`` = k1, ``mse`` = k2,
``low_var_kl`` = k3, ``kl+`` = k1+, ``low_var_kl+`` = k3+.

Clamping.  ``k3`` contains ``exp(r)``; a token the reference finds far more likely than
the policy (``r`` of a few tens) overflows float32 to ``inf`` and turns the loss and its
gradient into NaN.  ``log_ratio_clamp`` bounds ``r`` to ``[-c, c]`` before any estimator
is applied (default 20: ``exp(20) ~ 4.9e8`` stays finite even in bfloat16).
``value_clamp`` then bounds the estimate itself to ``[-v, v]`` (default 10, as AReaL, verl
and OpenRLHF do) so that one outlier token cannot dominate a KL penalty or loss.  Either
clamp zeroes the gradient of the tokens it touches; pass ``None`` to turn it off.  The k2
gradient of the straight-through variants is not clamped (as in verl).
"""

from __future__ import annotations

from typing import Any

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Estimators of the KL penalty inside the reward (AReaL's ``kl_estimator`` choices)."""
KL_LOSS_TYPES = ("k1", "k2", "k3", "k1+", "k3+", "kl", "mse", "low_var_kl", "kl+", "low_var_kl+")
"""Estimators of the KL loss term (verl's ``kl_loss_type`` choices, 'abs' and 'full' excepted)."""
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "low_var_kl+": "k3+"}


def canonical_kl_estimator(name: str) -> str:
    """``k1``, ``k2``, ``k3``, ``k1+`` or ``k3+`` for any accepted name (verl aliases included)."""
    canon = _ALIASES.get(name, name)
    if canon not in ("k1", "k2", "k3", "k1+", "k3+"):
        raise ValueError(f"unknown KL estimator '{name}'; choose one of {', '.join(KL_LOSS_TYPES)}")
    return canon


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    *,
    log_ratio_clamp: float | None = 20.0,
    value_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL estimate (same shape as the inputs, float32 or wider); masking is the caller's job."""
    canon = canonical_kl_estimator(estimator)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logprobs = logprobs.to(dtype)
    r = ref_logprobs.to(dtype) - logprobs
    if log_ratio_clamp is not None:
        r = r.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    base = canon.rstrip("+")
    if base == "k1":
        kl = -r
    elif base == "k2":
        kl = 0.5 * r.square()
    else:
        # expm1 keeps precision near r = 0, where exp(r) - 1 would cancel.
        kl = torch.expm1(r) - r
    if value_clamp is not None:
        kl = kl.clamp(min=-value_clamp, max=value_clamp)
    if canon.endswith("+"):
        # Straight through: the value of k1/k3, the gradient of k2 (verl's "+" estimators).
        k2 = 0.5 * (logprobs - ref_logprobs.to(dtype)).square()
        kl = k2 - k2.detach() + kl.detach()
    return kl


class KLController:
    """The coefficient of the KL penalty inside the reward: fixed, or adaptive (Ziegler et al. 2019).

    Adaptive: after each RL step, with ``kl`` the step's mean penalty KL and ``n`` its number
    of samples, ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon`` (verl's
    ``AdaptiveKLController``).  The coefficient is state: ``state_dict`` goes into checkpoints.
    """

    def __init__(self, init_coef: float, kind: str = "fixed", target: float = 0.1, horizon: float = 10000.0):
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"KL controller type '{kind}' is unknown; choose 'fixed' or 'adaptive'")
        if kind == "adaptive" and (target <= 0 or horizon <= 0):
            raise ValueError(f"the adaptive KL controller needs a positive target ({target}) and horizon ({horizon})")
        self.kind = kind
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_samples: int) -> None:
        if self.kind == "fixed":
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
