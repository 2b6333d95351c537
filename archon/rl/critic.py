"""The PPO critic: a value head on the same model types, trained with a clipped value loss."""

from __future__ import annotations

from typing import Any

import torch

from archon.engine.engine import ArchonEngine
from archon.rl.actor import mean_stats
from archon.rl.losses import loss_weight, make_critic_loss_fn
from archon.rl.rollout_batch import split_minibatches

Batch = dict[str, torch.Tensor]


class PPOCritic:
    """Values before each token (``compute_values``) and value-function updates (``ppo_update``)."""

    def __init__(self, engine: ArchonEngine, cfg: Any, *, agg_mode: str, max_new_tokens: int):
        self.engine = engine
        self.cfg = cfg
        self.agg_mode = agg_mode
        self.loss_fn = make_critic_loss_fn(value_eps_clip=cfg.eps_clip or None, agg_mode=agg_mode,
                                           max_response_len=max_new_tokens)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """``values[b, i]``: the value of the state before token ``i`` ``[B, S]``."""
        return self.engine.forward(batch)["values"]

    def ppo_update(self, batch: Batch) -> dict[str, float]:
        """Needs ``old_values`` (the values the advantages were computed with), ``returns``, ``loss_mask``."""
        mb_loss_mask = batch["loss_mask"]
        if self.cfg.mask_no_eos_with_zero and "seq_no_eos_mask" in batch:
            # Truncated responses have no trustworthy return: leave them out of the value loss.
            keep = (~batch["seq_no_eos_mask"].bool()).float().unsqueeze(1)
            batch = {**batch, "loss_mask": mb_loss_mask * keep}
        if float(batch["loss_mask"].sum()) == 0:
            return {}
        per_step = [self.engine.train_batch(mb, self.loss_fn, lambda m: loss_weight(m, self.agg_mode))
                    for mb in split_minibatches(batch, self.cfg.ppo_n_minibatches)]
        return mean_stats(per_step, "critic")
