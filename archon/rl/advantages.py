"""Rewards to advantages: reward shaping, group/batch normalisation, GAE, RLOO, REINFORCE++.

Everything here is a pure function of right-padded ``[B, S]`` tensors (and ``[B]``
per-sequence tensors).  Per-token tensors are token-aligned: position ``i`` of a row is
about token ``i`` (its logprob, the value of the state before it, its reward), and
``loss_mask[b, i] = 1`` on the completion tokens that are trained on.  The loss positions
of a row are taken in order and treated as consecutive steps of one episode; the
sequence reward sits on the last of them.  The value after the last one is 0 when the
response ended with EOS and, for GAE, the critic's value of the state after its last token
when it was truncated (``bootstrap_truncated``, as AReaL; verl always uses 0).

Samples of one prompt are consecutive rows, ``group_size`` rows per group.  Every rank
holds the whole global batch, so batch-level statistics here are global without any
communication, and advantages never depend on how the batch is later split.
"""

from __future__ import annotations

import torch

from archon.config import ActorConfig, NormConfig
from archon.config.preflight import check_group_normalisation
from archon.rl.kl import KL_ESTIMATORS, kl_estimate
from archon.rl.rollout_batch import TURN_REWARDS

ADV_ESTIMATORS = ("grpo", "gae", "rloo", "reinforce++")
_LEVELS = ("batch", "group", None)


def _level(name: str, value: str | None) -> str | None:
    """A normalisation level with 'none' (any case; the config's spelling) as None."""
    if isinstance(value, str) and value.lower() == "none":
        return None
    if value not in _LEVELS:
        raise ValueError(f"NormConfig.{name} = {value!r} is not valid; use 'batch', 'group' or None")
    return value


def _units(x: torch.Tensor, level: str, group_size: int) -> torch.Tensor:
    """Rows of ``x`` regrouped so that each row of the result is one statistics unit."""
    if level == "batch":
        return x.reshape(1, -1)
    if group_size < 1:
        raise ValueError(f"group-level normalisation needs group_size >= 1, got {group_size}")
    if x.shape[0] % group_size:
        raise ValueError(
            f"batch of {x.shape[0]} rows is not a multiple of group_size={group_size}; samples "
            "of one prompt must be consecutive rows, group_size of them per prompt"
        )
    return x.reshape(x.shape[0] // group_size, -1)


@torch.no_grad()
def normalize(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    mean_level: str | None,
    std_level: str | None,
    mean_leave1out: bool = False,
    std_unbiased: bool = True,
    eps: float = 1e-5,
    group_size: int = 0,
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the masked elements of each group or of the batch.

    ``x`` is ``[B]`` (sequence rewards) or ``[B, S]`` (token advantages; a group then
    holds every masked token of its rows).  As in AReaL's ``Normalization``, the std is the
    spread around the mean that was subtracted: ``sqrt(sum over the std_level unit of
    (x - mean)^2 / dof)``, with each element's own mean (group, batch, leave-one-out, or 0
    when ``mean_level`` is None).  With equal mean and std levels this is the usual std.  A
    unit with too few elements for a std (0, or 1 when unbiased) is not scaled; a
    leave-one-out mean of a single element is 0.  Statistics are in float64; the result is
    float32 and 0 outside ``mask``.
    """
    mean_level, std_level = _level("mean_level", mean_level), _level("std_level", std_level)
    if group_size < 0:
        raise ValueError(f"NormConfig.group_size = {group_size} must be positive, or 0 for the caller's")
    m = torch.ones_like(x, dtype=torch.float64) if mask is None else mask.to(torch.float64)
    v = torch.where(m > 0, x.to(torch.float64), 0.0)
    out = v
    if mean_level is not None:
        vu, mu = _units(v, mean_level, group_size), _units(m, mean_level, group_size)
        total, count = vu.sum(-1, keepdim=True), mu.sum(-1, keepdim=True)
        if mean_leave1out:
            mean = torch.where(count > 1, (total - vu) / (count - 1).clamp(min=1), 0.0)
        else:
            mean = total / count.clamp(min=1)
        out = out - mean.expand_as(vu).reshape(v.shape)
    if std_level is not None:
        cu, mu = _units(out, std_level, group_size), _units(m, std_level, group_size)
        count = mu.sum(-1, keepdim=True)
        sq = (cu.square() * mu).sum(-1, keepdim=True)
        dof = count - 1 if std_unbiased else count
        std = torch.where(dof > 0, (sq / dof.clamp(min=1)).sqrt() + eps, 1.0)
        out = out / std.expand_as(cu).reshape(v.shape)
    return torch.where(m > 0, out, 0.0).float()


def normalize_with(
    x: torch.Tensor, mask: torch.Tensor | None, norm: NormConfig | None, *, group_size: int = 0
) -> torch.Tensor:
    """``normalize`` with the options of a config ``NormConfig``; None, or both levels 'none', returns ``x``
    (masked, float32).  ``norm.group_size`` 0 takes ``group_size``."""
    if norm is None or norm.is_identity:
        return x.float() if mask is None else torch.where(mask > 0, x.float(), 0.0)
    return normalize(
        x,
        mask,
        mean_level=norm.mean_level,
        std_level=norm.std_level,
        mean_leave1out=norm.mean_leave1out,
        std_unbiased=norm.std_unbiased,
        eps=norm.eps,
        group_size=norm.group_size or group_size,
    )


# ----------------------------------------------------------------------------------------
# Reward shaping (per sequence)
# ----------------------------------------------------------------------------------------


def overlong_penalty(
    response_lengths: torch.Tensor, *, overlong_tokens: int, overlong_penalty_factor: float, max_new_tokens: int
) -> torch.Tensor:
    """DAPO's soft overlong penalty (<= 0): linear from 0 at ``max_new_tokens - overlong_tokens``
    tokens down to ``-overlong_penalty_factor`` at ``max_new_tokens``."""
    if overlong_tokens <= 0:
        raise ValueError(f"overlong_tokens = {overlong_tokens} must be positive when overlong_reward_penalty is on")
    if overlong_tokens > max_new_tokens:
        raise ValueError(
            f"overlong_tokens = {overlong_tokens} is larger than max_new_tokens = {max_new_tokens}; "
            "the penalty window must fit inside the generation budget"
        )
    exceed = response_lengths.to(torch.float32) - (max_new_tokens - overlong_tokens)
    return (-exceed / overlong_tokens * overlong_penalty_factor).clamp(max=0.0)


def shape_rewards(
    rewards: torch.Tensor,
    *,
    reward_bias: float = 0.0,
    reward_scaling: float = 1.0,
    reward_clip: float | None = None,
    response_lengths: torch.Tensor | None = None,
    overlong_reward_penalty: bool = False,
    overlong_tokens: int = 0,
    overlong_penalty_factor: float = 1.0,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """Sequence rewards ``[B]``: overlong penalty added first, then ``(r + bias) * scaling``
    clipped to ``[-reward_clip, reward_clip]`` (no clip when None or <= 0)."""
    r = rewards.to(torch.float32)
    if overlong_reward_penalty:
        if response_lengths is None or max_new_tokens is None:
            raise ValueError("overlong_reward_penalty needs the response lengths and max_new_tokens")
        r = r + overlong_penalty(
            response_lengths,
            overlong_tokens=overlong_tokens,
            overlong_penalty_factor=overlong_penalty_factor,
            max_new_tokens=max_new_tokens,
        )
    r = (r + reward_bias) * reward_scaling
    if reward_clip is not None and reward_clip > 0:
        r = r.clamp(min=-reward_clip, max=reward_clip)
    return r


# ----------------------------------------------------------------------------------------
# Token rewards, returns and GAE
# ----------------------------------------------------------------------------------------


def last_loss_index(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last loss token of each row ``[B]`` and whether the row has any ``[B]``."""
    m = loss_mask > 0
    seq_len = m.shape[1]
    idx = seq_len - 1 - m.flip(1).long().argmax(dim=1)
    return idx, m.any(dim=1)


def token_rewards(
    seq_rewards: torch.Tensor, loss_mask: torch.Tensor, *, kl: torch.Tensor | None = None, kl_ctl: float = 0.0
) -> torch.Tensor:
    """``[B, S]`` rewards: the sequence reward on the last loss token, minus ``kl_ctl * kl``
    on every loss token; 0 elsewhere (a row without loss tokens gets nothing)."""
    m = (loss_mask > 0).to(torch.float32)
    out = torch.zeros_like(m)
    if kl is not None and kl_ctl != 0.0:
        out = out - kl_ctl * torch.where(m > 0, kl.to(torch.float32), 0.0)
    idx, has_any = last_loss_index(loss_mask)
    rows = torch.arange(m.shape[0], device=m.device)
    out[rows, idx] += torch.where(has_any, seq_rewards.to(torch.float32), 0.0)
    return out


def turn_credit(turn_rewards: torch.Tensor, loss_mask: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """``[B, S]``: what moves an episode's reward from its last sampled id to the ends of the turns that earned it.

    ``turn_rewards`` (``TURN_REWARDS``) holds each turn's reward on its last sampled id; the credit is those
    rewards times ``scale`` minus their sum on the row's last loss token, so the row's token rewards still add
    up to its shaped sequence reward (bias, clipping and penalties apply to the episode) while a return-to-go
    (GAE, REINFORCE++) sees each turn's reward where the turn ended.
    """
    credit = turn_rewards.to(torch.float32) * scale * (loss_mask > 0)
    idx, has_any = last_loss_index(loss_mask)
    rows = torch.arange(credit.shape[0], device=credit.device)
    credit[rows, idx] -= torch.where(has_any, credit.sum(dim=1), 0.0)
    return credit


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    discount: float,
    gae_lambda: float,
    end_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the loss positions of each row.

    For consecutive loss positions ``t`` (next loss position ``t'``, or the end):
    ``delta_t = r_t + discount * V_{t'} - V_t`` and
    ``A_t = delta_t + discount * gae_lambda * A_{t'}``, where ``V_end`` is ``end_values[b]``
    (the value of the state after the row's last loss token; 0 when None).  Returns
    ``(advantages, returns)`` with ``returns = advantages + values``; both 0 outside
    ``loss_mask``.
    """
    m = loss_mask > 0
    r = torch.where(m, rewards.to(torch.float32), 0.0)
    v = torch.where(m, values.to(torch.float32), 0.0)
    next_value = torch.zeros(r.shape[0], dtype=torch.float32, device=r.device)
    if end_values is not None:
        next_value = next_value + end_values.to(torch.float32)
    next_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + discount * next_value - v[:, t]
        a = delta + discount * gae_lambda * next_adv
        # Non-loss positions neither produce an advantage nor break the chain of loss positions.
        adv[:, t] = torch.where(m[:, t], a, 0.0)
        next_adv = torch.where(m[:, t], a, next_adv)
        next_value = torch.where(m[:, t], v[:, t], next_value)
    return adv, torch.where(m, adv + v, 0.0)


def discounted_returns(rewards: torch.Tensor, loss_mask: torch.Tensor, *, discount: float) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + discount * G_{t'}`` over the loss positions of each row."""
    adv, _ = gae_advantages(
        rewards, torch.zeros_like(rewards, dtype=torch.float32), loss_mask, discount=discount, gae_lambda=1.0
    )
    return adv


def broadcast_to_tokens(seq_values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, S]``: each row's value on its loss tokens, 0 elsewhere."""
    return torch.where(loss_mask > 0, seq_values.to(torch.float32).unsqueeze(1), 0.0)


def group_normalized_rewards(seq_rewards: torch.Tensor, norm: NormConfig | None, *, group_size: int) -> torch.Tensor:
    """GRPO / Dr.GRPO: sequence rewards normalised with ``norm`` (group mean and std by default)."""
    return normalize_with(seq_rewards, None, norm, group_size=group_size)


def rloo_rewards(seq_rewards: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """RLOO: each reward minus the mean reward of the other samples of its prompt (no std)."""
    return normalize(seq_rewards, None, mean_level="group", std_level=None, mean_leave1out=True, group_size=group_size)


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    discount: float,
    eps: float = 1e-5,
    norm_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted token returns, normalised by their mean and std over all loss
    tokens of the batch (over ``norm_mask`` when given).  ``rewards`` are token rewards
    (sequence reward on the last loss token, optionally minus a KL penalty).  Returns
    ``(advantages, returns)``."""
    returns = discounted_returns(rewards, loss_mask, discount=discount)
    adv = normalize(
        returns, loss_mask if norm_mask is None else norm_mask, mean_level="batch", std_level="batch", eps=eps
    )
    return adv, returns


# ----------------------------------------------------------------------------------------
# The whole pipeline
# ----------------------------------------------------------------------------------------


def check_advantage_options(actor: ActorConfig, *, group_size: int) -> None:
    """Reject an actor section whose advantages cannot work, before the run starts: an unknown
    estimator, or a normalisation over groups of one sample (GRPO would learn nothing).
    ``group_size`` is the resolved samples per prompt (``actor.group_size`` or ``gconfig.n_samples``)."""
    if actor.adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"adv_estimator = '{actor.adv_estimator}' is unknown; choose one of {', '.join(ADV_ESTIMATORS)}"
        )
    check_group_normalisation(actor, group_size)  # also run by the preflight before any process starts
    if actor.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator = '{actor.kl_estimator}' is unknown; choose one of {', '.join(KL_ESTIMATORS)}")
    if group_size < 1:
        raise ValueError(f"group_size = {group_size} must be at least 1")


@torch.no_grad()
def compute_advantages(
    batch: dict[str, torch.Tensor],
    cfg: ActorConfig,
    *,
    group_size: int,
    max_new_tokens: int | None = None,
    kl_ctl: float | None = None,
) -> dict[str, torch.Tensor]:
    """Token advantages for a rollout batch, with the options of the actor section ``cfg``
    (names as AReaL's actor config; ``check_advantage_options`` has accepted it).

    ``group_size`` is the resolved samples per prompt (consecutive rows; ``cfg.group_size``
    is not read, as it may be 0), ``max_new_tokens`` the generation budget (needed by the
    overlong penalty), and ``kl_ctl`` the current KL-penalty coefficient (an adaptive
    controller's value; None takes ``cfg.kl_ctl``).

    Reads ``rewards [B]``, ``loss_mask``, and as needed ``seq_no_eos_mask [B]``,
    ``values`` and ``values_after [B]`` ('gae'; the critic's value of the state after each
    row's last token), ``old_logprobs`` (or ``logprobs``) and ``ref_logprobs`` (``kl_ctl``).
    Steps: overlong penalty, bias/scale/clip; the estimator's sequence baseline ('grpo'
    and 'gae': ``reward_norm``; 'rloo': leave-one-out group mean; 'reinforce++': none);
    ``mask_no_eos_with_zero``; token rewards (+ KL penalty); then GAE with the critic
    (truncated rows bootstrapped with ``values_after`` when ``bootstrap_truncated``), or
    the discounted reward-to-go (REINFORCE++ then normalises it over the batch); finally
    ``adv_norm``, over the loss tokens of the rows ``overlong_filtering`` keeps.  Agent batches with per-turn
    rewards (``TURN_REWARDS``) credit each turn where it ended under 'gae' and 'reinforce++' (``turn_credit``);
    the group baselines ('grpo', 'rloo') compare whole episodes.  Returns
    ``advantages``, ``returns``, ``token_rewards`` and ``kl`` (the per-token penalty KL, 0
    without ``kl_ctl``) (``[B, S]``, 0 outside ``loss_mask``) and the shaped sequence
    ``rewards`` ``[B]``.
    """
    kl_ctl = cfg.kl_ctl if kl_ctl is None else kl_ctl
    loss_mask = batch["loss_mask"]
    m = loss_mask > 0
    truncated = None
    if cfg.mask_no_eos_with_zero or cfg.overlong_filtering or (cfg.adv_estimator == "gae" and cfg.bootstrap_truncated):
        if "seq_no_eos_mask" not in batch:
            raise ValueError(
                "mask_no_eos_with_zero, overlong_filtering and GAE bootstrapping need "
                "'seq_no_eos_mask' [B] in the batch"
            )
        truncated = batch["seq_no_eos_mask"].bool()
    seq = shape_rewards(
        batch["rewards"],
        reward_bias=cfg.reward_bias,
        reward_scaling=cfg.reward_scaling,
        reward_clip=cfg.reward_clip,
        response_lengths=m.sum(dim=1),
        overlong_reward_penalty=cfg.overlong_reward_penalty,
        overlong_tokens=cfg.overlong_tokens,
        overlong_penalty_factor=cfg.overlong_penalty_factor,
        max_new_tokens=max_new_tokens,
    )
    if cfg.adv_estimator in ("grpo", "gae"):
        seq = group_normalized_rewards(seq, cfg.reward_norm, group_size=group_size)
    elif cfg.adv_estimator == "rloo":
        seq = rloo_rewards(seq, group_size=group_size)
    if cfg.mask_no_eos_with_zero:
        assert truncated is not None  # set above whenever mask_no_eos_with_zero
        seq = torch.where(truncated, 0.0, seq)

    kl = torch.zeros_like(m, dtype=torch.float32)
    if kl_ctl != 0.0:
        if "ref_logprobs" not in batch:
            raise ValueError(
                "kl_ctl is set but the batch has no 'ref_logprobs'; configure a reference model or set kl_ctl = 0"
            )
        logp = batch["old_logprobs"] if "old_logprobs" in batch else batch["logprobs"]
        kl = torch.where(m, kl_estimate(logp, batch["ref_logprobs"], cfg.kl_estimator), 0.0)
    rewards = token_rewards(seq, loss_mask, kl=kl, kl_ctl=kl_ctl)
    if TURN_REWARDS in batch and cfg.adv_estimator in ("gae", "reinforce++"):
        rewards = rewards + turn_credit(batch[TURN_REWARDS], loss_mask, scale=cfg.reward_scaling)
    # Overlong filtering drops truncated rows from the actor loss, so they take no part in
    # batch statistics of advantages either.
    adv_mask = loss_mask
    if cfg.overlong_filtering:
        assert truncated is not None  # set above whenever overlong_filtering
        adv_mask = torch.where(truncated.unsqueeze(1), 0, loss_mask)

    if cfg.adv_estimator == "gae":
        if "values" not in batch:
            raise ValueError(
                "adv_estimator = 'gae' needs critic 'values' in the batch; add a critic "
                "or use 'grpo'/'rloo'/'reinforce++'"
            )
        end_values = None
        if cfg.bootstrap_truncated:
            assert truncated is not None  # set above for 'gae' with bootstrap_truncated
            if "values_after" not in batch:
                raise ValueError(
                    "bootstrap_truncated needs the critic's 'values_after' [B] in the batch "
                    "(PPOCritic.compute_values returns them)"
                )
            end_values = torch.where(truncated, batch["values_after"].to(torch.float32), 0.0)
        adv, returns = gae_advantages(
            rewards, batch["values"], loss_mask, discount=cfg.discount, gae_lambda=cfg.gae_lambda, end_values=end_values
        )
    elif cfg.adv_estimator == "reinforce++":
        adv, returns = reinforce_pp_advantages(rewards, loss_mask, discount=cfg.discount, norm_mask=adv_mask)
    else:
        adv = returns = discounted_returns(rewards, loss_mask, discount=cfg.discount)

    adv = normalize_with(adv, adv_mask, cfg.adv_norm, group_size=group_size)
    return {"advantages": adv, "returns": returns, "token_rewards": rewards, "kl": kl, "rewards": seq}
