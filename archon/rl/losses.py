"""PPO-family actor and critic losses, their aggregation, and the engine's loss weights.

Tensors are right-padded ``[b, s]`` and token-aligned (see ``archon.rl.advantages``);
``loss_mask`` selects the tokens that are trained on.

How microbatch losses combine.  The engine calls ``loss_fn(outputs, mb)`` on every
microbatch and scales the returned loss by ``loss_weight(mb, agg_mode) / total_weight``,
where ``total_weight`` sums ``loss_weight`` over the whole global batch.  Each aggregation
mode is a weighted mean of per-microbatch aggregates with these weights, so the result
equals the aggregate over the global batch for any split into microbatches or ranks:

========================== ====================================================== ================================
``agg_mode``               aggregate over a (micro)batch                          ``loss_weight``
========================== ====================================================== ================================
``token-mean``             sum of token losses / number of loss tokens            number of loss tokens
``seq-mean-token-sum``     mean over sequences of their token-loss sums           sequences with a loss token
``seq-mean-token-mean``    mean over sequences of their token-loss means          sequences with a loss token
``seq-mean-token-sum-norm`` mean over sequences of token-loss sum / max_response_len sequences with a loss token
========================== ====================================================== ================================

Sequences without any loss token take no part (they count neither as tokens nor as
sequences).  Statistics are aggregated the same way so that they too can be averaged with
these weights: as a token mean under ``token-mean`` and as a mean of per-sequence token
means under the ``seq-mean-*`` modes.

Scales against AReaL and verl.  ``token-mean``, ``seq-mean-token-sum`` and
``seq-mean-token-mean`` equal verl's ``agg_loss`` over the global batch (AReaL has only
``token-mean``).  ``seq-mean-token-sum-norm`` is Dr.GRPO's definition: the mean over
sequences of ``token-loss sum / max_response_len`` with the constant
``gconfig.max_new_tokens``.  verl's mode of that name divides by the padded response width
of the micro-batch (unless ``loss_scale_factor`` is set) and sums, rather than averages, over
the sequences of each micro-batch before its ``1 / gradient_accumulation`` scale, so (without
``use_dynamic_bsz``) its loss is Archon's times verl's per-GPU micro-batch size
(``ppo_micro_batch_size_per_gpu``): port a verl learning rate for this mode by multiplying
it by that size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from archon.rl.kl import kl_estimate
from archon.rl.rejection_sampling import RejectionSampling, behaviour_weights

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Bound on log importance ratios before exp(): a ratio of e^20 is already meaningless for
# PPO and larger values overflow to inf, which turns masked-out gradients into NaN.
_MAX_LOG_RATIO = 20.0
# Sequence-level (GSPO) log ratio bound, as verl uses.
_MAX_SEQ_LOG_RATIO = 10.0

Batch = dict[str, torch.Tensor]
LossFn = Callable[[Batch, Batch], tuple[torch.Tensor, Batch]]


def _check_agg_mode(agg_mode: str, max_response_len: int | None = None) -> None:
    if agg_mode not in AGG_MODES:
        raise ValueError(f"loss aggregation mode '{agg_mode}' is unknown; choose one of {', '.join(AGG_MODES)}")
    if agg_mode == "seq-mean-token-sum-norm" and not max_response_len:
        raise ValueError(
            "loss_agg_mode 'seq-mean-token-sum-norm' divides by a constant max_response_len; "
            "pass max_response_len (normally gconfig.max_new_tokens)"
        )


def aggregate(
    per_token: torch.Tensor, loss_mask: torch.Tensor, agg_mode: str, max_response_len: int | None = None
) -> torch.Tensor:
    """Reduce ``[b, s]`` per-token values over the loss tokens to a scalar (see the module table).

    An empty selection gives 0 that is still connected to ``per_token``'s graph, so a
    microbatch without loss tokens can run backward like the others.
    """
    _check_agg_mode(agg_mode, max_response_len)
    m = loss_mask > 0
    x = torch.where(m, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if agg_mode == "token-mean":
        return x.sum() / m.sum().clamp(min=1)
    token_count = m.sum(dim=-1)
    seq_sum = x.sum(dim=-1)
    n_seqs = (token_count > 0).sum().clamp(min=1)
    if agg_mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif agg_mode == "seq-mean-token-mean":
        per_seq = seq_sum / token_count.clamp(min=1)
    else:
        per_seq = seq_sum / float(max_response_len)  # type: ignore[arg-type]
    return per_seq.sum() / n_seqs


def loss_weight(mb: Batch, agg_mode: str) -> float:
    """The weight of a microbatch's aggregate in the global aggregate (see the module table)."""
    _check_agg_mode(agg_mode, max_response_len=1)
    m = mb["loss_mask"] > 0
    if agg_mode == "token-mean":
        return float(m.sum())
    return float(m.any(dim=-1).sum()) if m.dim() > 1 else float(m.any())


def stats_agg_mode(agg_mode: str) -> str:
    """How statistics are averaged under ``agg_mode`` so that ``loss_weight`` also weights them."""
    return "token-mean" if agg_mode == "token-mean" else "seq-mean-token-mean"


def _masked_log_ratio(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    return torch.where(mask, a - b, zero).clamp(min=-_MAX_LOG_RATIO, max=_MAX_LOG_RATIO)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over each row's loss tokens, broadcast back to ``[b, s]``."""
    count = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return (torch.where(mask, x, 0.0).sum(dim=-1, keepdim=True) / count).expand_as(x)


def ppo_actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_logprobs: torch.Tensor | None = None,
    rejection_sampling: RejectionSampling | None = None,
    importance_sampling_level: str = "token",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    agg_mode: str = "token-mean",
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, Batch]:
    """Clipped PPO policy loss with the usual variants; returns ``(loss, stats)``.

    Per loss token, with ratio ``rho = exp(logprobs - old_logprobs)`` and advantage ``A``:
    ``l = max(-A * rho, -A * clip(rho, 1 - eps_clip, 1 + eps_clip_higher))``.

    - ``eps_clip_higher``: upper clip (DAPO clip-higher); None or 0 uses ``eps_clip``.
    - ``c_clip``: dual clip (Ye et al. 2020): for ``A < 0`` the loss is further capped at
      ``-c_clip * A``; None or 0 disables it.
    - ``importance_sampling_level='sequence'`` (GSPO): every token of a sequence uses the
      sequence ratio ``s = exp(mean over its loss tokens of (logprobs - old_logprobs))``
      as its value, clipped like a token ratio, and the sequence's mean advantage (as AReaL
      does); the gradient of token ``t`` flows through its own logprob with factor ``s``
      (``logprobs - sg(logprobs) + sg(log s)``, the GSPO-token form verl uses).  Under
      ``seq-mean-token-mean`` this is the GSPO objective exactly (verl's ``gspo`` loss always
      aggregates so); under ``token-mean`` every sequence weighs by its length, which is
      AReaL's GSPO.  ``log s`` is bounded by 10.
    - Decoupled PPO (``behav_logprobs`` given): ``old_logprobs`` is the proximal policy
      recomputed by the trainer and ``behav_logprobs`` the rollout engine's.  The clipped
      term is multiplied by the behaviour importance weight of ``rejection_sampling``
      (``archon.rl.rejection_sampling``: ``pi_prox / pi_behav``, with out-of-bounds tokens
      masked or clamped; None applies no correction, as AReaL).  Masked tokens keep no
      policy-gradient term but still count in the normalisation, so loss weights stay a
      function of ``loss_mask`` alone; the entropy and KL terms keep every loss token.
    - ``entropy_coef * aggregate(entropy)`` is subtracted, ``kl_loss_coef *
      aggregate(kl_estimate(logprobs, ref_logprobs, kl_loss_type))`` added (``archon.rl.kl``
      says which KL each estimator's gradient follows).

    Stats (detached scalars, see ``stats_agg_mode``): ``loss``, ``pg_loss``, ``clip_frac``
    (loss tokens where the clipped branch is active, i.e. where the ratio is outside the
    clip range in the direction the advantage pushes), ``dual_clip_frac``, ``ratio_mean``,
    ``approx_kl`` (k2 estimate ``0.5 * (logprobs - old_logprobs)**2``), ``advantages_mean``
    and, when used, ``entropy``, ``kl_loss``, ``behav_imp_weight`` (mean applied weight),
    ``behav_filtered_frac`` (tokens rejected or clamped) and ``behav_approx_kl``.
    """
    _check_agg_mode(agg_mode, max_response_len)
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level = '{importance_sampling_level}' must be 'token' or 'sequence'")
    if c_clip and c_clip <= 1.0:
        raise ValueError(f"c_clip = {c_clip} must be greater than 1 (dual clip), or 0/None to disable it")
    mask = loss_mask > 0
    # Ratios of bf16 logprobs would be off by ~1%; the loss is computed in float32 or wider.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logprobs = logprobs.to(dtype)
    old_logprobs = old_logprobs.detach().to(dtype)
    adv = torch.where(mask, advantages.detach().to(dtype), 0.0)

    stats_mode = stats_agg_mode(agg_mode)
    f32 = torch.float32
    stats: Batch = {}
    keep, weight = mask, None
    if behav_logprobs is not None:
        weight, keep, filtered = behaviour_weights(old_logprobs, behav_logprobs.detach(), mask, rejection_sampling)
        weight = weight.to(dtype)
        behav_log_w = torch.where(keep, old_logprobs - behav_logprobs.detach().to(dtype), 0.0)
        stats["behav_imp_weight"] = aggregate(weight.to(f32), mask, stats_mode)
        stats["behav_filtered_frac"] = aggregate(filtered.to(f32), mask, stats_mode)
        stats["behav_approx_kl"] = aggregate(torch.nan_to_num(behav_log_w).to(f32), mask, stats_mode)

    log_ratio = _masked_log_ratio(logprobs, old_logprobs, mask)
    if importance_sampling_level == "sequence":
        # The sequence ratio and advantage are means over the tokens that keep a gradient.
        seq_log_ratio = _seq_mean(log_ratio.detach(), keep).clamp(max=_MAX_SEQ_LOG_RATIO)
        log_ratio = torch.where(mask, logprobs - logprobs.detach(), 0.0) + seq_log_ratio
        adv = torch.where(keep, _seq_mean(adv, keep), 0.0)
    ratio = torch.exp(log_ratio)

    upper = eps_clip_higher if eps_clip_higher else eps_clip
    clipped_ratio = ratio.clamp(min=1.0 - eps_clip, max=1.0 + upper)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * clipped_ratio
    pg = torch.maximum(loss_unclipped, loss_clipped)
    clip_mask = (loss_clipped > loss_unclipped) & mask
    if c_clip:
        cap = -c_clip * adv
        dual_mask = (adv < 0) & (pg > cap) & mask
        pg = torch.where(dual_mask, cap, pg)
    else:
        dual_mask = torch.zeros_like(mask)
    if weight is not None:
        pg = pg * weight

    pg_loss = aggregate(pg, mask, agg_mode, max_response_len)
    loss = pg_loss
    if entropy is not None:
        entropy_mean = aggregate(entropy.to(dtype), mask, agg_mode, max_response_len)
        if entropy_coef:
            loss = loss - entropy_coef * entropy_mean
        stats["entropy"] = aggregate(entropy.detach().to(f32), mask, stats_mode)
    elif entropy_coef:
        raise ValueError("entropy_coef is set but no entropy was given; the engine must return 'entropy'")
    if kl_loss_coef:
        if ref_logprobs is None:
            raise ValueError("kl_loss_coef is set but no ref_logprobs were given; configure a reference model")
        # Padding logprobs may be -inf/NaN; zero them before the estimator so no NaN reaches backward.
        ref = torch.where(mask, ref_logprobs.detach().to(dtype), 0.0)
        kl = torch.where(mask, kl_estimate(torch.where(mask, logprobs, 0.0), ref, kl_loss_type), 0.0)
        loss = loss + kl_loss_coef * aggregate(kl, mask, agg_mode, max_response_len)
        stats["kl_loss"] = aggregate(kl.detach().to(f32), mask, stats_mode)

    ratio_d = ratio.detach().to(f32)
    stats.update(
        loss=loss.detach().to(f32),
        pg_loss=pg_loss.detach().to(f32),
        clip_frac=aggregate(clip_mask.to(f32), mask, stats_mode),
        dual_clip_frac=aggregate(dual_mask.to(f32), mask, stats_mode),
        ratio_mean=aggregate(ratio_d, mask, stats_mode),
        approx_kl=aggregate(0.5 * (logprobs.detach() - old_logprobs).to(f32).square(), mask, stats_mode),
        advantages_mean=aggregate(adv.to(f32), mask, stats_mode),
    )
    return loss, stats


def ppo_critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    value_eps_clip: float | None = None,
    loss_fn_type: str = "mse",
    huber_delta: float = 10.0,
    agg_mode: str = "token-mean",
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, Batch]:
    """Clipped value loss ``max(f(v - R), f(v_clip - R))`` with
    ``v_clip = old + clamp(v - old, -value_eps_clip, value_eps_clip)`` (None or 0: unclipped).

    ``f`` is ``0.5 * d^2`` (``loss_fn_type='mse'``) or the Huber loss ``0.5 * d^2`` for
    ``|d| < huber_delta`` and ``huber_delta * (|d| - huber_delta / 2)`` beyond (``'huber'``;
    AReaL's critic loss offers the same two, with delta 10).

    Stats: ``value_loss``, ``value_clip_frac`` (loss tokens where the clipped error is the
    larger one), ``values_mean``, ``returns_mean``.
    """
    _check_agg_mode(agg_mode, max_response_len)
    if loss_fn_type not in ("mse", "huber"):
        raise ValueError(f"critic loss_fn_type = '{loss_fn_type}' must be 'mse' or 'huber'")
    if loss_fn_type == "huber" and huber_delta <= 0:
        raise ValueError(f"huber_delta = {huber_delta} must be positive")
    mask = loss_mask > 0
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    returns = returns.detach().to(values.dtype)

    def f(pred: torch.Tensor) -> torch.Tensor:
        d = (pred - returns).abs()
        if loss_fn_type == "mse":
            return 0.5 * d.square()
        return torch.where(d < huber_delta, 0.5 * d.square(), huber_delta * (d - 0.5 * huber_delta))

    per_token = f(values)
    if value_eps_clip:
        old = old_values.detach().to(values.dtype)
        clipped = f(old + (values - old).clamp(min=-value_eps_clip, max=value_eps_clip))
        clip_mask = (clipped > per_token) & mask
        per_token = torch.maximum(per_token, clipped)
    else:
        clip_mask = torch.zeros_like(mask)
    loss = aggregate(per_token, mask, agg_mode, max_response_len)
    stats_mode = stats_agg_mode(agg_mode)
    f32 = torch.float32
    stats = dict(
        value_loss=loss.detach().to(f32),
        value_clip_frac=aggregate(clip_mask.to(f32), mask, stats_mode),
        values_mean=aggregate(values.detach().to(f32), mask, stats_mode),
        returns_mean=aggregate(returns.to(f32), mask, stats_mode),
    )
    return loss, stats


# ----------------------------------------------------------------------------------------
# Engine adapters: loss_fn(outputs, mb) closures over the options
# ----------------------------------------------------------------------------------------

# Batch keys the adapters read (per-token [b, s] unless noted):
#   loss_mask, advantages            always (actor)
#   old_logprobs                     proximal policy (trainer recompute); falls back to `logprobs`
#   logprobs                         behaviour policy from the rollout engine (decoupled loss)
#   ref_logprobs                     reference model (kl_loss_coef)
#   old_values, returns              critic


def make_actor_loss_fn(
    *, use_decoupled_loss: bool = False, proximal_from_outputs: bool = False, **ppo_kwargs
) -> LossFn:
    """A ``loss_fn(outputs, mb)`` for the engine: ``outputs`` has ``logprobs`` (and
    ``entropy``); ``mb`` the keys listed above.  ``ppo_kwargs`` go to ``ppo_actor_loss``.

    ``proximal_from_outputs``: the proximal (old) logprobs are ``outputs['logprobs']`` detached,
    valid when the weights being trained are the proximal policy (the first optimizer step)."""
    if "eps_clip" not in ppo_kwargs:
        raise TypeError("make_actor_loss_fn needs eps_clip")
    _check_agg_mode(ppo_kwargs.get("agg_mode", "token-mean"), ppo_kwargs.get("max_response_len"))

    def loss_fn(outputs: Batch, mb: Batch) -> tuple[torch.Tensor, Batch]:
        if proximal_from_outputs:
            old = outputs["logprobs"].detach()
        else:
            old = mb["old_logprobs"] if "old_logprobs" in mb else mb["logprobs"]
        return ppo_actor_loss(
            outputs["logprobs"],
            old,
            mb["advantages"],
            mb["loss_mask"],
            behav_logprobs=mb["logprobs"] if use_decoupled_loss else None,
            entropy=outputs.get("entropy"),
            ref_logprobs=mb.get("ref_logprobs"),
            **ppo_kwargs,
        )

    return loss_fn


def make_critic_loss_fn(
    *,
    value_eps_clip: float | None = None,
    loss_fn_type: str = "mse",
    huber_delta: float = 10.0,
    agg_mode: str = "token-mean",
    max_response_len: int | None = None,
) -> LossFn:
    """A ``loss_fn(outputs, mb)`` for the critic engine: ``outputs['values']``, ``mb['old_values']``,
    ``mb['returns']``, ``mb['loss_mask']``."""
    _check_agg_mode(agg_mode, max_response_len)

    def loss_fn(outputs: Batch, mb: Batch) -> tuple[torch.Tensor, Batch]:
        return ppo_critic_loss(
            outputs["values"],
            mb["old_values"],
            mb["returns"],
            mb["loss_mask"],
            value_eps_clip=value_eps_clip,
            loss_fn_type=loss_fn_type,
            huber_delta=huber_delta,
            agg_mode=agg_mode,
            max_response_len=max_response_len,
        )

    return loss_fn
