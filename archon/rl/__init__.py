"""RL algorithms: advantages, losses, KL estimators and rewards.

Names are imported lazily so that reward worker processes, which import only
``archon.rl.rewards``, do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazily imported names, for type checkers and editors
    from archon.rl.advantages import (
        check_advantage_options,
        compute_advantages,
        gae_advantages,
        normalize,
        normalize_with,
        shape_rewards,
        token_rewards,
    )
    from archon.rl.dynamic_filter import collect_mixed_groups
    from archon.rl.kl import KLController, kl_estimate
    from archon.rl.losses import (
        aggregate,
        loss_weight,
        make_actor_loss_fn,
        make_critic_loss_fn,
        ppo_actor_loss,
        ppo_critic_loss,
    )
    from archon.rl.rejection_sampling import RejectionSampling
    from archon.rl.rewards import RewardComputer, get_reward_fn

_EXPORTS = {
    "check_advantage_options": "advantages",
    "compute_advantages": "advantages",
    "gae_advantages": "advantages",
    "normalize": "advantages",
    "normalize_with": "advantages",
    "shape_rewards": "advantages",
    "token_rewards": "advantages",
    "KLController": "kl",
    "kl_estimate": "kl",
    "RejectionSampling": "rejection_sampling",
    "collect_mixed_groups": "dynamic_filter",
    "aggregate": "losses",
    "loss_weight": "losses",
    "make_actor_loss_fn": "losses",
    "make_critic_loss_fn": "losses",
    "ppo_actor_loss": "losses",
    "ppo_critic_loss": "losses",
    "RewardComputer": "rewards",
    "get_reward_fn": "rewards",
}

__all__ = [
    "KLController",
    "RejectionSampling",
    "RewardComputer",
    "aggregate",
    "check_advantage_options",
    "collect_mixed_groups",
    "compute_advantages",
    "gae_advantages",
    "get_reward_fn",
    "kl_estimate",
    "loss_weight",
    "make_actor_loss_fn",
    "make_critic_loss_fn",
    "normalize",
    "normalize_with",
    "ppo_actor_loss",
    "ppo_critic_loss",
    "shape_rewards",
    "token_rewards",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"archon.rl.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'archon.rl' has no attribute '{name}'")
