"""Rejection sampling for the decoupled PPO loss: the behaviour importance weight and which tokens keep it.

In decoupled PPO the rollout engine's (behaviour) policy ``pi_behav`` differs from the
proximal policy ``pi_prox`` the trainer recomputes; the clipped surrogate is multiplied by
``w = pi_prox / pi_behav`` (a constant).  Stale or mismatched samples make ``w`` large, so
tokens or sequences whose divergence is out of bounds are either dropped (``'mask'``) or get
their weight clamped (``'clamp'``).  The options and their semantics are AReaL's
``RejectionSamplingConfig`` (``areal/api/cli_args.py``, ``apply_rejection_sampling`` in
``areal/utils/functional``):

- ``metric``: ``'ratio'`` (``w`` itself) or a KL estimate of the per-token divergence,
  ``'kl_k1'`` / ``'kl_k2'`` / ``'kl_k3'`` of ``(log pi_prox, log pi_behav)``;
- ``level='token'``: each token is judged by its own metric; ``'sequence'``: by the
  aggregate (``agg`` = sum, mean or max over the sequence's loss tokens; for ``'ratio'`` the
  sum and mean are taken in log space, so ``mean`` is the geometric mean) and the whole
  sequence shares the verdict.  With ``'ratio'`` at sequence level the weight of every token
  is the sequence's geometric-mean ratio;
- in bounds means ``lower <= metric <= upper`` (no lower bound when ``lower`` is None);
- ``'mask'`` gives rejected tokens weight 0 (they still count in the loss normalisation, as
  in AReaL); ``'clamp'`` (``'ratio'`` only) clamps the weight of out-of-bounds tokens to
  ``[lower or 0, upper]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from archon.rl.kl import kl_estimate

RS_LEVELS = ("token", "sequence")
RS_ACTIONS = ("mask", "clamp")
RS_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
RS_AGGS = ("sum", "mean", "max")
# exp() of a log ratio beyond this is already far outside any sensible bound, and larger
# values overflow float32.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class RejectionSampling:
    """Options of ``behaviour_weights`` (AReaL's ``RejectionSamplingConfig``)."""

    level: str = "token"
    """'token' or 'sequence': the unit that is judged."""
    action: str = "mask"
    """'mask' (drop out-of-bounds tokens) or 'clamp' (bound their weight; metric 'ratio' only)."""
    metric: str = "ratio"
    """'ratio' (pi_prox / pi_behav) or 'kl_k1', 'kl_k2', 'kl_k3'."""
    agg: str = "mean"
    """Sequence level: 'sum', 'mean' or 'max' over the sequence's loss tokens."""
    upper: float = 5.0
    """Upper bound of the metric."""
    lower: float | None = None
    """Lower bound of the metric; None: no lower bound."""

    def __post_init__(self) -> None:
        for name, choices in (("level", RS_LEVELS), ("action", RS_ACTIONS), ("metric", RS_METRICS), ("agg", RS_AGGS)):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"rejection_sampling.{name} = {getattr(self, name)!r} must be one of {', '.join(choices)}"
                )
        if self.lower is not None and self.lower > self.upper:
            raise ValueError(f"rejection_sampling.lower = {self.lower} is above upper = {self.upper}")
        if self.metric == "ratio" and self.upper <= 1.0:
            raise ValueError(
                f"rejection_sampling.upper = {self.upper} must be above 1 for metric 'ratio' "
                "(otherwise every token whose policies differ is rejected)"
            )
        if self.metric == "ratio" and self.lower is not None and self.lower <= 0:
            raise ValueError(f"rejection_sampling.lower = {self.lower} must be positive for metric 'ratio'")
        if self.metric in ("kl_k2", "kl_k3") and self.upper <= 0:
            raise ValueError(f"rejection_sampling.upper = {self.upper} must be positive for metric '{self.metric}'")
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                f"rejection_sampling.action = 'clamp' bounds the importance ratio and needs metric "
                f"'ratio', not '{self.metric}'; use action 'mask' with KL metrics"
            )

    @classmethod
    def from_config(cls, cfg: Any) -> RejectionSampling | None:
        """From an object with these fields (``archon.config.RejectionSamplingConfig``); level 'none' gives None
        and a lower bound of -inf means none."""
        if cfg is None or cfg.level == "none":
            return None
        lower = None if cfg.lower is None or cfg.lower == float("-inf") else float(cfg.lower)
        return cls(
            level=cfg.level, action=cfg.action, metric=cfg.metric, agg=cfg.agg, upper=float(cfg.upper), lower=lower
        )

    def in_bounds(self, metric: torch.Tensor) -> torch.Tensor:
        ok = metric <= self.upper
        return ok & (metric >= self.lower) if self.lower is not None else ok


def _seq_reduce(x: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """``[b, s] -> [b, 1]``: sum, mean or max over each row's ``mask`` (0 for a row without any)."""
    if agg == "max":
        out = torch.where(mask, x, float("-inf")).amax(dim=-1, keepdim=True)
        return torch.where(mask.any(dim=-1, keepdim=True), out, 0.0)
    total = torch.where(mask, x, 0.0).sum(dim=-1, keepdim=True)
    return total if agg == "sum" else total / mask.sum(dim=-1, keepdim=True).clamp(min=1)


@torch.no_grad()
def behaviour_weights(
    prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor, rs: RejectionSampling | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weight, keep, filtered)``, all ``[b, s]``, for logprobs and a boolean loss ``mask``.

    ``weight`` is the importance weight applied to each token's surrogate (0 where not kept or
    outside ``mask``); ``keep`` the tokens that keep a policy-gradient term; ``filtered`` the
    loss tokens that were rejected ('mask') or whose weight was clamped ('clamp').  Without
    ``rs`` there is no correction (weight 1, AReaL's default).
    """
    if rs is None:
        return mask.float(), mask, torch.zeros_like(mask)
    log_ratio = torch.where(mask, prox_logprobs.float() - behav_logprobs.float(), 0.0)
    # -inf - -inf at padding (or a token the engine could not score) must not poison the step.
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if rs.metric == "ratio":
        metric = log_ratio  # judged in log space (exp'd below), so sequence sums and means are geometric
    else:
        # kl_estimate's r is ref - logp; with logp = 0 and ref = -log_ratio, r = log(pi_behav / pi_prox).
        metric = kl_estimate(
            torch.zeros_like(log_ratio),
            -log_ratio,
            rs.metric.removeprefix("kl_"),
            log_ratio_clamp=None,
            value_clamp=None,
        )
    weight = torch.exp(log_ratio)
    if rs.level == "sequence":
        if rs.metric == "ratio":
            weight = torch.exp(_seq_reduce(log_ratio, mask, "mean")).expand_as(log_ratio)
        seq_metric = _seq_reduce(metric, mask, rs.agg)
        unit_metric = (torch.exp(seq_metric) if rs.metric == "ratio" else seq_metric).expand_as(log_ratio)
    else:
        unit_metric = torch.exp(metric) if rs.metric == "ratio" else metric
    out_of_bounds = ~rs.in_bounds(unit_metric) & mask
    if rs.action == "mask":
        keep = mask & ~out_of_bounds
        filtered = out_of_bounds
    else:
        clamped = weight.clamp(min=rs.lower if rs.lower is not None else 0.0, max=rs.upper)
        filtered = out_of_bounds & (clamped != weight)
        weight = torch.where(out_of_bounds, clamped, weight)
        keep = mask
    return torch.where(keep, weight, 0.0), keep, filtered
