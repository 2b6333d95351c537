"""The PPO/GRPO actor (and the frozen reference and teacher models) on a training engine.

Every rank holds the whole rollout batch; the engine takes its data-parallel share and
returns results in the original sample order, so actor, critic and reference may have
different allocations over the same ranks.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist

from archon.config import ActorConfig
from archon.engine import TrainEngine
from archon.rl.distill import distillation_loss
from archon.rl.losses import aggregate, loss_weight, make_actor_loss_fn
from archon.rl.offpolicy import proximal_metrics, proximal_sums
from archon.rl.rejection_sampling import RejectionSampling
from archon.rl.rollout_batch import FRESH_MASK, ppo_minibatches

Batch = dict[str, torch.Tensor]
logger = logging.getLogger("archon.rl")


def mean_stats(per_step: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Average each statistic over the optimizer steps of one RL step, under ``prefix``."""
    keys = sorted({k for stats in per_step for k in stats})
    out = {}
    for key in keys:
        values = [s[key] for s in per_step if key in s and s[key] is not None]
        if values:
            out[f"{prefix}/{key}"] = sum(values) / len(values)
    return out


class PPOActor:
    """Policy updates with PPO-family losses; ``compute_logprobs`` for old/proximal logprobs."""

    def __init__(self, engine: TrainEngine, cfg: ActorConfig, *, max_new_tokens: int):
        self.engine = engine
        self.cfg = cfg
        self.agg_mode = cfg.loss_agg_mode
        self.max_new_tokens = max_new_tokens
        loss_options: dict[str, Any] = dict(
            use_decoupled_loss=cfg.use_decoupled_loss,
            eps_clip=cfg.eps_clip,
            eps_clip_higher=cfg.eps_clip_higher or None,
            c_clip=cfg.c_clip or None,
            rejection_sampling=RejectionSampling.from_config(cfg.rejection_sampling),
            importance_sampling_level=cfg.importance_sampling_level,
            entropy_coef=cfg.entropy_coef,
            kl_loss_coef=cfg.kl_loss_coef,
            kl_loss_type=cfg.kl_loss_type,
            agg_mode=cfg.loss_agg_mode,
            max_response_len=max_new_tokens,
        )
        self.loss_fn = make_actor_loss_fn(**loss_options)
        # The same loss with the proximal logprobs taken from the update's own forward.
        self.loss_fn_proximal_from_outputs = make_actor_loss_fn(proximal_from_outputs=True, **loss_options)
        if (
            cfg.importance_sampling_level == "sequence"
            and cfg.loss_agg_mode != "seq-mean-token-mean"
            and (not dist.is_initialized() or dist.get_rank() == 0)
        ):
            logger.warning(
                "GSPO (importance_sampling_level = 'sequence') with loss_agg_mode = '%s' weighs each "
                "sequence by its length, as AReaL's GSPO does; the GSPO objective (verl's gspo loss) "
                "needs loss_agg_mode = 'seq-mean-token-mean'",
                cfg.loss_agg_mode,
            )

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """Per-token logprobs of the current policy ``[B, S]`` (0 at each row's first token)."""
        return self.engine.forward(batch)["logprobs"]

    def single_step_update(self) -> bool:
        """Whether ``ppo_update`` makes one optimizer step, so that the weights it trains are the
        proximal policy throughout (the condition for ``proximal_from_update``)."""
        return self.cfg.ppo_n_minibatches == 1 and self.cfg.ppo_epochs == 1

    def _loss_with_mismatch(
        self, outputs: Batch, mb: Batch, proximal_from_update: bool = False
    ) -> tuple[torch.Tensor, Batch]:
        if proximal_from_update:
            loss, stats = self.loss_fn_proximal_from_outputs(outputs, mb)
            weight = loss_weight(mb, self.agg_mode)
            stats.update(
                proximal_sums(outputs["logprobs"], mb["logprobs"], mb["loss_mask"], weight, mb.get(FRESH_MASK))
            )
        else:
            loss, stats = self.loss_fn(outputs, mb)
        if self.cfg.kd_coef:
            # On-policy distillation toward the teacher's logprobs of the sampled tokens.
            kd, stats["kd_loss"] = distillation_loss(
                outputs["logprobs"],
                mb["teacher_logprobs"],
                mb["loss_mask"],
                estimator=self.cfg.kd_estimator,
                agg_mode=self.agg_mode,
                max_response_len=self.max_new_tokens,
            )
            loss = loss + self.cfg.kd_coef * kd
            stats["loss"] = loss.detach().float()
        # The training/inference mismatch before this update: |trainer - rollout server| logprob.
        diff = (outputs["logprobs"].detach() - mb["logprobs"]).abs()
        stats["behav_logprob_diff"] = aggregate(
            diff, mb["loss_mask"], "token-mean" if self.agg_mode == "token-mean" else "seq-mean-token-mean"
        )
        return loss, stats

    def ppo_update(self, batch: Batch, proximal_from_update: bool = False) -> dict[str, float]:
        """``ppo_epochs`` passes of ``ppo_n_minibatches`` optimizer steps over the batch (rows
        shuffled per pass with ``shuffle``); mean statistics under ``actor/``.

        ``proximal_from_update`` (only with ``single_step_update()``): the proximal logprobs are
        those of the update's own forward, detached: the weights it computes the loss with are the
        proximal policy, so a separate ``compute_logprobs`` pass before it would give the same
        values.  ``behav_prox_logprob_diff`` and ``behav_ratio/*`` of the batch are then returned too.

        The batch needs ``advantages``, ``loss_mask``, ``logprobs`` (behaviour) and, when the
        proximal policy was recomputed, ``old_logprobs``; ``ref_logprobs`` for the KL loss;
        ``teacher_logprobs`` for distillation (``kd_coef``); ``seq_no_eos_mask`` for
        ``overlong_filtering`` (truncated rows leave the loss).
        """
        cfg = self.cfg
        if cfg.overlong_filtering:
            keep = (~batch["seq_no_eos_mask"].bool()).float().unsqueeze(1)
            batch = {**batch, "loss_mask": batch["loss_mask"] * keep}
        if float(batch["loss_mask"].sum()) == 0:
            return {}  # every response was filtered out: nothing to step on
        assert not proximal_from_update or self.single_step_update(), "proximal_from_update needs one optimizer step"
        per_step = []
        first_diff = None
        # The shuffle seed is the run seed and the optimizer step this update starts at: the
        # same for every allocation, and restored with the engine on resume.
        for mb in ppo_minibatches(
            batch,
            cfg.ppo_n_minibatches,
            epochs=cfg.ppo_epochs,
            shuffle=cfg.shuffle,
            seed=self.engine.seed * 65_537 + self.engine.step,
        ):
            stats = self.engine.train_batch(
                mb,
                functools.partial(self._loss_with_mismatch, proximal_from_update=proximal_from_update),
                lambda m: loss_weight(m, self.agg_mode),
            )
            if first_diff is None:
                first_diff = stats.get("behav_logprob_diff")
            stats.pop("behav_logprob_diff", None)
            per_step.append(stats)
        proximal = proximal_metrics(per_step[0], int(batch["loss_mask"].sum())) if proximal_from_update else {}
        out: dict[str, Any] = mean_stats(per_step, "actor")
        out.update(proximal)
        out["actor/behav_logprob_diff_first_mb"] = first_diff  # None if no minibatch reported it
        return out


class ReferenceModel:
    """A frozen model scoring sampled tokens: the reference for KL terms, or the distillation teacher
    (its own engine and allocation).

    ``adapters_off``: ``engine`` is the LoRA actor's, and the reference is its base model with the adapters
    off (no second copy of the weights).
    """

    def __init__(self, engine: TrainEngine, adapters_off: bool = False):
        self.engine = engine
        self.adapters_off = adapters_off

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.adapters_off:
            with self.engine.adapters_off():
                return self.engine.forward(batch)["logprobs"]
        return self.engine.forward(batch)["logprobs"]
