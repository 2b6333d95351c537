"""The PPO critic: a value head on the same model types, trained with a clipped value loss."""

from __future__ import annotations

import torch

from archon.config import CriticConfig
from archon.engine import TrainEngine
from archon.rl.actor import mean_stats
from archon.rl.losses import loss_weight, make_critic_loss_fn
from archon.rl.rollout_batch import ppo_minibatches

Batch = dict[str, torch.Tensor]


class PPOCritic:
    """Values before each token (``compute_values``) and value-function updates (``ppo_update``)."""

    def __init__(self, engine: TrainEngine, cfg: CriticConfig, *, agg_mode: str, max_new_tokens: int):
        self.engine = engine
        self.cfg = cfg
        self.agg_mode = agg_mode
        self.loss_fn = make_critic_loss_fn(
            value_eps_clip=cfg.eps_clip or None,
            loss_fn_type=cfg.loss_fn_type,
            huber_delta=cfg.huber_delta,
            agg_mode=agg_mode,
            max_response_len=max_new_tokens,
        )

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``values [B, S]`` and ``values_after [B]``.

        ``values[b, i]`` is the value of the state before token ``i``; ``values_after[b]`` the
        value of the state after row ``b``'s last token, which GAE bootstraps a truncated
        response from.  The engine's outputs at position ``i`` only see tokens ``< i``, so one
        placeholder token appended after each row yields that value without changing the others
        (so each row is one token longer here: ``mb_spec.max_tokens_per_mb`` must leave room).
        """
        ids, attn = batch["input_ids"], batch["attention_mask"]
        rows, width = ids.shape
        lengths = attn.sum(dim=1).long()
        grown = {
            "input_ids": torch.cat([ids, ids.new_zeros(rows, 1)], dim=1),
            "attention_mask": torch.cat([attn, attn.new_zeros(rows, 1)], dim=1),
        }
        grown["attention_mask"][torch.arange(rows), lengths] = 1
        values = self.engine.forward(grown)["values"]
        # The placeholder's own position is padding of the original rows: 0 there, as forward gives.
        return torch.where(attn > 0, values[:, :width], 0.0), values[torch.arange(rows), lengths]

    def ppo_update(self, batch: Batch) -> dict[str, float]:
        """Needs ``old_values`` (the values the advantages were computed with), ``returns``, ``loss_mask``."""
        mb_loss_mask = batch["loss_mask"]
        if self.cfg.mask_no_eos_with_zero and "seq_no_eos_mask" in batch:
            # Truncated responses have no trustworthy return: leave them out of the value loss.
            keep = (~batch["seq_no_eos_mask"].bool()).float().unsqueeze(1)
            batch = {**batch, "loss_mask": mb_loss_mask * keep}
        if float(batch["loss_mask"].sum()) == 0:
            return {}
        per_step = [
            self.engine.train_batch(mb, self.loss_fn, lambda m: loss_weight(m, self.agg_mode))
            for mb in ppo_minibatches(
                batch,
                self.cfg.ppo_n_minibatches,
                epochs=self.cfg.ppo_epochs,
                shuffle=self.cfg.shuffle,
                seed=self.engine.seed * 65_537 + self.engine.step,
            )
        ]
        return mean_stats(per_step, "critic")
