"""RL algorithms: advantages, losses, KL estimators and rewards.

Names are imported lazily so that reward worker processes, which import only
``archon.rl.rewards``, do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

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

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"archon.rl.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'archon.rl' has no attribute '{name}'")
