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

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch

from archon.rl.kl import KL_ESTIMATORS, kl_estimate

ADV_ESTIMATORS = ("grpo", "gae", "rloo", "reinforce++")
_LEVELS = ("batch", "group", None)


@dataclass(frozen=True)
class NormConfig:
    """How to centre and scale a tensor of rewards or advantages."""

    mean_level: str | None = "group"
    """Subtract the mean over the 'group' (rows of one prompt), the whole 'batch', or None (no centring)."""
    std_level: str | None = "group"
    """Divide by the std over 'group', 'batch', or None (no scaling; Dr.GRPO)."""
    mean_leave1out: bool = False
    """Each element's baseline is the mean of the others in its group/batch (RLOO)."""
    std_unbiased: bool = True
    """Use the n-1 (Bessel) denominator for the std."""
    eps: float = 1e-5
    """Added to the std before dividing."""
    group_size: int = 0
    """Rows per group for group-level statistics (the batch size must be a multiple); 0 takes the caller's."""

    def __post_init__(self) -> None:
        # Config files spell "no level" as the string "none"; store it as None.
        for name in ("mean_level", "std_level"):
            value = getattr(self, name)
            if isinstance(value, str) and value.lower() == "none":
                object.__setattr__(self, name, None)
            elif value not in _LEVELS:
                raise ValueError(f"NormConfig.{name} = {value!r} is not valid; use 'batch', 'group' or None")
        if self.group_size < 0:
            raise ValueError(f"NormConfig.group_size = {self.group_size} must be positive, or 0 for the caller's")

    @property
    def is_identity(self) -> bool:
        return self.mean_level is None and self.std_level is None

    @classmethod
    def from_config(cls, cfg: Any) -> NormConfig | None:
        """From any object with NormConfig's fields (e.g. ``archon.config.NormConfig``);
        None, or both levels 'none', gives None (no normalisation)."""
        if cfg is None:
            return None
        norm = cls(
            mean_level=cfg.mean_level,
            std_level=cfg.std_level,
            mean_leave1out=cfg.mean_leave1out,
            std_unbiased=cfg.std_unbiased,
            eps=cfg.eps,
            group_size=getattr(cfg, "group_size", 0) or 0,
        )
        return None if norm.is_identity else norm


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
    cfg = NormConfig(mean_level, std_level, mean_leave1out, std_unbiased, eps, group_size)
    m = torch.ones_like(x, dtype=torch.float64) if mask is None else mask.to(torch.float64)
    v = torch.where(m > 0, x.to(torch.float64), 0.0)
    out = v
    if cfg.mean_level is not None:
        vu, mu = _units(v, cfg.mean_level, group_size), _units(m, cfg.mean_level, group_size)
        total, count = vu.sum(-1, keepdim=True), mu.sum(-1, keepdim=True)
        if cfg.mean_leave1out:
            mean = torch.where(count > 1, (total - vu) / (count - 1).clamp(min=1), 0.0)
        else:
            mean = total / count.clamp(min=1)
        out = out - mean.expand_as(vu).reshape(v.shape)
    if cfg.std_level is not None:
        cu, mu = _units(out, cfg.std_level, group_size), _units(m, cfg.std_level, group_size)
        count = mu.sum(-1, keepdim=True)
        sq = (cu.square() * mu).sum(-1, keepdim=True)
        dof = count - 1 if cfg.std_unbiased else count
        std = torch.where(dof > 0, (sq / dof.clamp(min=1)).sqrt() + cfg.eps, 1.0)
        out = out / std.expand_as(cu).reshape(v.shape)
    return torch.where(m > 0, out, 0.0).float()


def normalize_with(x: torch.Tensor, mask: torch.Tensor | None, norm: NormConfig | None) -> torch.Tensor:
    """``normalize`` with the options of a NormConfig; None returns ``x`` (masked, float32)."""
    if norm is None or norm.is_identity:
        return x.float() if mask is None else torch.where(mask > 0, x.float(), 0.0)
    return normalize(x, mask, **dataclasses.asdict(norm))


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


def group_normalized_rewards(seq_rewards: torch.Tensor, norm: NormConfig | None) -> torch.Tensor:
    """GRPO / Dr.GRPO: sequence rewards normalised with ``norm`` (group mean and std by default)."""
    return normalize_with(seq_rewards, None, norm)


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


def default_norms(adv_estimator: str) -> tuple[NormConfig | None, NormConfig | None]:
    """``(reward_norm, adv_norm)`` of an estimator when the user sets neither: GRPO normalises
    rewards by group mean/std; PPO with a critic (standard PPO) leaves rewards raw and whitens
    advantages over the batch; RLOO and REINFORCE++ have their own baselines."""
    if adv_estimator == "gae":
        return None, NormConfig(mean_level="batch", std_level="batch")
    return (NormConfig() if adv_estimator == "grpo" else None), None


@dataclass(frozen=True)
class AdvantageConfig:
    """Options of ``compute_advantages``; names follow AReaL's actor config."""

    adv_estimator: str = "grpo"
    """'grpo' (reward_norm, Dr.GRPO when std_level is None), 'gae' (critic), 'rloo', or 'reinforce++'."""
    group_size: int = 1
    """Samples per prompt (consecutive rows)."""
    discount: float = 1.0
    """Discount factor (GAE and the reward-to-go of the critic-free estimators)."""
    gae_lambda: float = 1.0
    """GAE lambda (used by 'gae' only)."""
    kl_ctl: float = 0.0
    """Per-token KL-to-reference penalty inside the reward; 0 disables it."""
    kl_estimator: str = "k1"
    """Estimator of that per-token KL: 'k1', 'k2' or 'k3'."""
    reward_scaling: float = 1.0
    """Rewards are (reward + reward_bias) * reward_scaling ..."""
    reward_bias: float = 0.0
    """... with this bias added first ..."""
    reward_clip: float = 20.0
    """... then clipped to [-reward_clip, reward_clip] (<= 0 disables the clip)."""
    overlong_reward_penalty: bool = False
    """DAPO soft penalty for responses longer than max_new_tokens - overlong_tokens."""
    overlong_tokens: int = 0
    """Length of the penalty window."""
    overlong_penalty_factor: float = 1.0
    """Penalty at max_new_tokens."""
    max_new_tokens: int | None = None
    """Generation budget (needed by the overlong penalty)."""
    mask_no_eos_with_zero: bool = False
    """Responses cut off without EOS get a final (normalised) reward of 0; they still train."""
    overlong_filtering: bool = False
    """Responses cut off without EOS get advantage 0 and are left out of adv_norm (DAPO overlong filtering)."""
    bootstrap_truncated: bool = True
    """'gae': a truncated response's last step bootstraps from ``values_after`` (AReaL); False ends it (verl)."""
    reward_norm: NormConfig | None | str = "default"
    """Normalisation of sequence rewards for 'grpo' and 'gae'; None leaves them raw; 'default':
    group mean/std for 'grpo', None for 'gae' (standard PPO, as AReaL leaves it unset)."""
    adv_norm: NormConfig | None | str = "default"
    """Final normalisation of token advantages over loss tokens; None disables it; 'default':
    batch mean/std for 'gae' (AReaL's PPO recipe; verl always whitens GAE advantages), else None."""

    def __post_init__(self) -> None:
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(
                f"adv_estimator = '{self.adv_estimator}' is unknown; choose one of {', '.join(ADV_ESTIMATORS)}"
            )
        reward_norm, adv_norm = default_norms(self.adv_estimator)
        if self.reward_norm == "default":
            object.__setattr__(self, "reward_norm", reward_norm)
        if self.adv_norm == "default":
            object.__setattr__(self, "adv_norm", adv_norm)
        # "default" was replaced above; any other string is not a norm either way.
        used: list[tuple[str, NormConfig | None]] = [("adv_norm", cast("NormConfig | None", self.adv_norm))]
        if self.adv_estimator in ("grpo", "gae"):
            used.insert(0, ("reward_norm", cast("NormConfig | None", self.reward_norm)))
        for name, norm in used:
            if norm is None or "group" not in (norm.mean_level, norm.std_level):
                continue
            size = norm.group_size or self.group_size
            if size == 1:
                raise ValueError(
                    f"{name} normalises over groups of samples of one prompt, but every group has "
                    "one sample, so each value would be normalised against itself (GRPO would learn "
                    "nothing); sample several completions per prompt (gconfig.n_samples > 1, and "
                    f"actor.group_size 0 or > 1) or set {name}.mean_level/std_level to 'batch' or "
                    "'none'"
                )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator = '{self.kl_estimator}' is unknown; choose one of {', '.join(KL_ESTIMATORS)}"
            )
        if self.group_size < 1:
            raise ValueError(f"group_size = {self.group_size} must be at least 1")

    @classmethod
    def from_actor_config(cls, actor: Any, max_new_tokens: int | None = None) -> AdvantageConfig:
        """From an object with the actor config's field names (``archon.config.ActorConfig``)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("reward_norm", "adv_norm", "max_new_tokens")]
        kwargs = {n: getattr(actor, n) for n in names if hasattr(actor, n)}
        return cls(
            **kwargs,
            max_new_tokens=max_new_tokens,
            reward_norm=NormConfig.from_config(getattr(actor, "reward_norm", None)),
            adv_norm=NormConfig.from_config(getattr(actor, "adv_norm", None)),
        )


def _with_group_size(norm: NormConfig | str | None, group_size: int) -> NormConfig | None:
    norm = cast("NormConfig | None", norm)  # AdvantageConfig.__post_init__ replaced "default"
    return norm if norm is None or norm.group_size else dataclasses.replace(norm, group_size=group_size)


@torch.no_grad()
def compute_advantages(batch: dict[str, torch.Tensor], cfg: AdvantageConfig) -> dict[str, torch.Tensor]:
    """Token advantages for a rollout batch.

    Reads ``rewards [B]``, ``loss_mask``, and as needed ``seq_no_eos_mask [B]``,
    ``values`` and ``values_after [B]`` ('gae'; the critic's value of the state after each
    row's last token), ``old_logprobs`` (or ``logprobs``) and ``ref_logprobs`` (``kl_ctl``).
    Steps: overlong penalty, bias/scale/clip; the estimator's sequence baseline ('grpo'
    and 'gae': ``reward_norm``; 'rloo': leave-one-out group mean; 'reinforce++': none);
    ``mask_no_eos_with_zero``; token rewards (+ KL penalty); then GAE with the critic
    (truncated rows bootstrapped with ``values_after`` when ``bootstrap_truncated``), or
    the discounted reward-to-go (REINFORCE++ then normalises it over the batch); finally
    ``adv_norm``, over the loss tokens of the rows ``overlong_filtering`` keeps.  Returns
    ``advantages``, ``returns``, ``token_rewards`` and ``kl`` (the per-token penalty KL, 0
    without ``kl_ctl``) (``[B, S]``, 0 outside ``loss_mask``) and the shaped sequence
    ``rewards`` ``[B]``.
    """
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
        max_new_tokens=cfg.max_new_tokens,
    )
    if cfg.adv_estimator in ("grpo", "gae"):
        seq = group_normalized_rewards(seq, _with_group_size(cfg.reward_norm, cfg.group_size))
    elif cfg.adv_estimator == "rloo":
        seq = rloo_rewards(seq, group_size=cfg.group_size)
    if cfg.mask_no_eos_with_zero:
        assert truncated is not None  # set above whenever mask_no_eos_with_zero
        seq = torch.where(truncated, 0.0, seq)

    kl = torch.zeros_like(m, dtype=torch.float32)
    if cfg.kl_ctl != 0.0:
        if "ref_logprobs" not in batch:
            raise ValueError(
                "kl_ctl is set but the batch has no 'ref_logprobs'; configure a reference model or set kl_ctl = 0"
            )
        logp = batch["old_logprobs"] if "old_logprobs" in batch else batch["logprobs"]
        kl = torch.where(m, kl_estimate(logp, batch["ref_logprobs"], cfg.kl_estimator), 0.0)
    rewards = token_rewards(seq, loss_mask, kl=kl, kl_ctl=cfg.kl_ctl)
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

    adv = normalize_with(adv, adv_mask, _with_group_size(cfg.adv_norm, cfg.group_size))
    return {"advantages": adv, "returns": returns, "token_rewards": rewards, "kl": kl, "rewards": seq}
