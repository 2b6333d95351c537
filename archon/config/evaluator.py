"""The ``evaluator`` config section: when a run evaluates the policy on ``valid_dataset`` and how (AReaL's
``evaluator.freq_steps`` / ``freq_secs``; ``archon.eval`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from archon.config.dataset import DatasetConfig


@dataclass
class EvaluatorConfig:
    freq_steps: int = 0
    """Evaluate after every N-th RL step (0: not by steps); with `valid_dataset.path` set, a run always evaluates
    before its first update (step 0) and after its last step."""
    freq_secs: float = 0.0
    """Evaluate once this many seconds of training passed since the last evaluation (AReaL's name); 0: not by time."""
    greedy: bool = True
    """Score one greedy completion (temperature 0) per prompt: eval/greedy_acc, eval/greedy_reward, eval/greedy_len."""
    n_samples: int = 4
    """Completions sampled per prompt at `temperature`: eval/pass@k for k = 1, 2, 4, ... up to n_samples (unbiased
    estimator), eval/mean_reward, eval/mean_len; 0 turns sampled evaluation off."""
    temperature: float = 0.6
    """Temperature of the sampled completions (AReaL's GSM8K example evaluates at 0.6); the other sampling fields are
    gconfig's."""
    max_new_tokens: int = 0
    """Longest completion of an evaluation; 0: gconfig.max_new_tokens."""
    max_prompts: int = 0
    """Evaluate only the first N prompts of valid_dataset (a quick check on a large set); 0: all of them."""
    correct_threshold: float = 1.0
    """A completion counts as correct (accuracy, pass@k) when its reward is at least this; 1 fits 0/1 rewards such as
    reward.fn = 'math'."""


@dataclass
class ValidDatasetConfig(DatasetConfig):
    """``valid_dataset``: train_dataset's fields, with an evaluation's defaults (every row once, in order)."""

    split: str = "test"
    """Split of a dataset folder with several (a single file is one split)."""
    batch_size: int = 64
    """Prompts whose requests (greedy and sampled) are in flight together in one round of an evaluation."""
    shuffle: bool = False
    """Not used: an evaluation takes the rows in order."""
    drop_last: bool = False
    """Not used: an evaluation takes every row."""
