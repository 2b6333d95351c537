"""On-policy distillation: the actor's loss term pulling it toward a fixed teacher.

The rollout samples tokens from the student ``pi``; the teacher scores the same tokens
(``teacher_logprobs``, forward only).  The term is the reverse KL ``KL(pi || pi_teacher)``
estimated on those tokens with one of ``archon.rl.kl``'s estimators, aggregated like the
policy loss.  On on-policy samples the gradient of ``k2 = (logp - logp_teacher)^2 / 2`` is
``(logp - logp_teacher) * grad logp``, whose expectation is the reverse KL's gradient (``k1``'s
gradient, ``grad logp``, averages to zero; ``k3``'s follows the forward KL).
"""

from __future__ import annotations

import torch

from archon.rl.kl import kl_estimate
from archon.rl.losses import aggregate, stats_agg_mode


def distillation_loss(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    estimator: str = "k2",
    agg_mode: str = "token-mean",
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(term, kd_stat)``: the aggregated KL estimate (differentiable in ``logprobs``) and its detached value.

    ``kd_stat`` is aggregated like the other loss statistics (``stats_agg_mode``) so the engine
    can average it over microbatches with the loss weights.
    """
    mask = loss_mask > 0
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    # Padding logprobs may be anything; zero both sides before the estimator so no NaN reaches backward.
    student = torch.where(mask, logprobs.to(dtype), 0.0)
    teacher = torch.where(mask, teacher_logprobs.detach().to(dtype), 0.0)
    kl = torch.where(mask, kl_estimate(student, teacher, estimator), 0.0)
    term = aggregate(kl, mask, agg_mode, max_response_len)
    return term, aggregate(kl.detach().to(torch.float32), mask, stats_agg_mode(agg_mode))
