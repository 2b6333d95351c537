"""Evaluation during an RL run: before the first update (step 0), every ``evaluator.freq_steps`` steps or
``evaluator.freq_secs`` seconds, and after the last step, at the weights the rollout servers hold then.

Every training rank calls ``due`` and ``run`` at the same points (both are collective).  Rank 0 generates and
scores (``archon.eval.evaluation``) and writes ``<run_dir>/eval/step_<N>.jsonl`` and ``step_<N>.metrics.json``;
the other ranks wait for its metrics, which every rank returns.  As for checkpoints, rank 0's clock decides when
``freq_secs`` is due.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from archon.checkpoint.schedule import IntervalSchedule
from archon.config import Config, ConfigError
from archon.data.from_config import build_rl_dataset
from archon.eval.evaluation import Evaluation, write_results
from archon.rl.rank0 import run_on_rank0
from archon.rl.rewards import RewardComputer
from archon.rl.scoring import CompletionScorer
from archon.rollout.client import RolloutClient

logger = logging.getLogger("archon.eval")


def build_evaluation(cfg: Config, tokenizer: Any, sampling: dict[str, Any]) -> Evaluation:
    """The evaluation ``cfg`` describes (``valid_dataset``, ``evaluator``), on the run's sampling parameters."""
    ev = cfg.evaluator
    dataset = build_rl_dataset(cfg.valid_dataset, tokenizer)
    n = len(dataset) if ev.max_prompts <= 0 else min(ev.max_prompts, len(dataset))
    try:
        return Evaluation(
            [dataset[i] for i in range(n)],
            ev,
            sampling=sampling,
            max_new_tokens=ev.max_new_tokens or cfg.gconfig.max_new_tokens,
            seed=cfg.seed,
            batch_size=cfg.valid_dataset.batch_size,
            tokenizer=tokenizer,
            max_concurrency=cfg.rollout.max_concurrent_rollouts,
        )
    except ValueError as exc:
        raise ConfigError(f"{exc} ({cfg.valid_dataset.path})") from None


class PeriodicEvaluation:
    """The RL loop's evaluations: ``due(step)`` says when, ``run(step, ...)`` evaluates (both collective)."""

    def __init__(self, cfg: Config, tokenizer: Any, sampling: dict[str, Any]):
        if cfg.rollout.workflow:
            raise ConfigError(
                "valid_dataset evaluates single-turn completions with reward.fn, but rollout.workflow runs agent "
                "episodes; leave valid_dataset.path empty for agent runs"
            )
        self.evaluation = build_evaluation(cfg, tokenizer, sampling)
        self.folder = Path(cfg.run_dir) / "eval"
        ev = cfg.evaluator
        self.schedule = IntervalSchedule(ev.freq_steps, ev.freq_secs, cfg.total_train_steps)

    def due(self, step: int) -> bool:
        """Whether step ``step`` ends with an evaluation (step 0: before any update)."""
        return step == 0 or self.schedule.due(step)

    def run(
        self, step: int, client: RolloutClient | None, rewards: RewardComputer | None, tokenizer: Any
    ) -> dict[str, float]:
        """Evaluate at step ``step`` (rank 0 generates and writes; ``client`` and ``rewards`` are rank 0's, None
        elsewhere); every rank returns the ``eval/*`` metrics."""

        def evaluate() -> dict[str, float]:
            assert client is not None and rewards is not None  # rank 0 connected and started them at setup
            samples, metrics = self.evaluation.run(client, CompletionScorer(rewards, tokenizer))
            path = write_results(self.folder, f"step_{step}", samples, metrics)
            logger.info(
                "evaluation at step %d: %s (%s)",
                step,
                ", ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in metrics.items()),
                path,
            )
            return metrics

        return run_on_rank0(evaluate, f"evaluation at step {step}")
