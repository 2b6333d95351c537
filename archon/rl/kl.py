"""Per-token estimators of KL(pi || pi_ref) from log-probabilities of sampled tokens.

The tokens were sampled from (approximately) ``pi``, so with ``r = ref_logp - logp``
(the log of ``pi_ref / pi`` at the sampled token) the classic estimators are
(Schulman, "Approximating KL Divergence"):

- ``k1 = -r = logp - ref_logp``: unbiased, high variance, can be negative;
- ``k2 = r**2 / 2``: biased, low variance, non-negative;
- ``k3 = exp(r) - r - 1``: unbiased, low variance, non-negative.

Clamping.  ``k3`` contains ``exp(r)``; a token the reference finds far more likely than
the policy (``r`` of a few tens) overflows float32 to ``inf`` and turns the loss and its
gradient into NaN.  ``log_ratio_clamp`` bounds ``r`` to ``[-c, c]`` before any estimator
is applied (default 20: ``exp(20) ~ 4.9e8`` stays finite even in bfloat16).
``value_clamp`` then bounds the estimate itself to ``[-v, v]`` (default 10, as AReaL and
OpenRLHF do) so that one outlier token cannot dominate a KL penalty or loss.  Either
clamp zeroes the gradient of the tokens it touches; pass ``None`` to turn it off.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    *,
    log_ratio_clamp: float | None = 20.0,
    value_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL estimate (same shape as the inputs, float32 or wider); masking is the caller's job."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{estimator}'; choose one of {', '.join(KL_ESTIMATORS)}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    r = ref_logprobs.to(dtype) - logprobs.to(dtype)
    if log_ratio_clamp is not None:
        r = r.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    if estimator == "k1":
        kl = -r
    elif estimator == "k2":
        kl = 0.5 * r.square()
    else:
        # expm1 keeps precision near r = 0, where exp(r) - 1 would cancel.
        kl = torch.expm1(r) - r
    if value_clamp is not None:
        kl = kl.clamp(min=-value_clamp, max=value_clamp)
    return kl
