"""Value ranges of numeric config keys: a value of the right type can still be nonsense.

``check_ranges(cfg, sources)`` raises one ``ConfigError`` for the first key out of range,
naming the key, its value, where it came from and what it must be.  Cross-field rules
(allocations, group sizes, ...) live in ``loading.validate_config``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from archon.config.schema import Config, ConfigError

_Rule = tuple[Callable[[Any], bool], str]

_NON_NEGATIVE: _Rule = (lambda v: v >= 0, "0 or more")
_POSITIVE: _Rule = (lambda v: v > 0, "greater than 0")
_AT_LEAST_1: _Rule = (lambda v: v >= 1, "at least 1")
_FRACTION: _Rule = (lambda v: 0 <= v <= 1, "between 0 and 1")

_OPTIMIZER_RULES: dict[str, _Rule] = {
    "lr": _NON_NEGATIVE,
    "weight_decay": _NON_NEGATIVE,
    "eps": _POSITIVE,
    "betas": (lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1), e.g. [0.9, 0.999]"),
    "warmup_steps": _NON_NEGATIVE,
    "min_lr_ratio": _FRACTION,
    "max_grad_norm": (_NON_NEGATIVE[0], "0 (no clipping) or more"),
}

RULES: dict[str, _Rule] = {
    **{f"{engine}.optimizer.{key}": rule for engine in ("actor", "critic") for key, rule in _OPTIMIZER_RULES.items()},
    "actor.mb_spec.max_tokens_per_mb": (_NON_NEGATIVE[0], "0 (no bound) or more"),
    "actor.eps_clip": _POSITIVE,
    "actor.eps_clip_higher": (_NON_NEGATIVE[0], "0 (use eps_clip) or more"),
    "actor.entropy_coef": _NON_NEGATIVE,
    "actor.kl_ctl": _NON_NEGATIVE,
    "actor.kl_loss_coef": _NON_NEGATIVE,
    "actor.discount": _FRACTION,
    "actor.gae_lambda": _FRACTION,
    "actor.reward_clip": _POSITIVE,
    "actor.ppo_epochs": _AT_LEAST_1,
    "actor.kl_ctl_target": _POSITIVE,
    "actor.kl_ctl_horizon": _POSITIVE,
    "critic.eps_clip": (_NON_NEGATIVE[0], "0 (no value clip) or more"),
    "gconfig.min_new_tokens": _NON_NEGATIVE,
    "gconfig.temperature": (_NON_NEGATIVE[0], "0 (greedy) or more"),
    "actor.temperature": (_NON_NEGATIVE[0], "0 (follow gconfig.temperature) or more"),
    "gconfig.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "gconfig.top_k": (lambda v: v == -1 or v >= 1, "-1 (off) or at least 1"),
    "gconfig.min_p": _FRACTION,
    "rollout.request_timeout": _POSITIVE,
    "rollout.request_retries": _NON_NEGATIVE,
    "rollout.setup_timeout": _POSITIVE,
    "rollout.weight_chunk_mb": _POSITIVE,
    "rollout.max_concurrent_rollouts": (_NON_NEGATIVE[0], "0 (the whole batch) or more"),
    "rollout.max_server_restarts": (_NON_NEGATIVE[0], "0 (never restart) or more"),
    "rollout.weight_check_freq": (lambda v: v >= -1, "-1 (by the loop), 0 (never check) or more"),
    "rollout.weight_check_tol": (_NON_NEGATIVE[0], "0 (by the servers' dtype) or more"),
    "rollout.mismatch_warn": (_NON_NEGATIVE[0], "0 (never warn) or more"),
    "rollout.mismatch_stop": (_NON_NEGATIVE[0], "0 (never stop) or more"),
    "sglang.context_length": (_NON_NEGATIVE[0], "0 (the model's own) or more"),
    "vllm.max_model_len": (_NON_NEGATIVE[0], "0 (the model's own) or more"),
    "vllm.gpu_memory_utilization": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "vllm.max_num_seqs": (_NON_NEGATIVE[0], "0 (vLLM's default) or more"),
    "cluster.gpu_memory_gb": _POSITIVE,
    "sglang.mem_fraction_static": (lambda v: 0 < v < 1, "in (0, 1)"),
    "sglang.max_running_requests": (_NON_NEGATIVE[0], "0 (SGLang's default) or more"),
    "train_dataset.max_length": _AT_LEAST_1,
    "reward.timeout_s": _POSITIVE,
    "reward.n_workers": (_NON_NEGATIVE[0], "0 (in the trainer process) or more"),
    "reward.max_failure_frac": (_FRACTION[0], "between 0 and 1 (1 never stops the run)"),
    "saver.freq_steps": (_NON_NEGATIVE[0], "0 (only at the end) or more"),
    "saver.keep_last": _AT_LEAST_1,
}


def _lookup(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def check_ranges(cfg: Config, sources: dict[str, str]) -> None:
    """Raise ``ConfigError`` naming the first key of ``RULES`` whose value is out of range (or NaN)."""
    for key, (ok, requirement) in RULES.items():
        value = _lookup(cfg, key)
        numbers = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and math.isnan(v) for v in numbers) or not ok(value):
            raise ConfigError(f"{key} = {value!r} (from {sources.get(key, 'the defaults')}) must be {requirement}")
    g = cfg.gconfig
    if g.min_new_tokens > g.max_new_tokens:
        raise ConfigError(
            f"gconfig.min_new_tokens = {g.min_new_tokens} is larger than gconfig.max_new_tokens = "
            f"{g.max_new_tokens}; lower min_new_tokens or raise max_new_tokens"
        )
    a = cfg.actor
    if a.overlong_reward_penalty and not 0 < a.overlong_tokens <= g.max_new_tokens:
        raise ConfigError(
            f"actor.overlong_tokens = {a.overlong_tokens} must be between 1 and gconfig.max_new_tokens "
            f"= {g.max_new_tokens} when actor.overlong_reward_penalty is on"
        )
    rollouts = cfg.train_dataset.batch_size * g.n_samples
    if a.ppo_n_minibatches > rollouts:
        raise ConfigError(
            f"actor.ppo_n_minibatches = {a.ppo_n_minibatches} is more than the {rollouts} samples of a "
            "step (train_dataset.batch_size x gconfig.n_samples); lower it or raise the batch size"
        )
