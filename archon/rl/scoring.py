"""Scoring a round of rollouts: the reward of each completion, from rank 0's reward workers.

Both rollout strategies (``archon.rl.rollout_strategy``, ``archon.rl.async_rollout``) are given a
``ScoreFn``; the trainer builds it as a ``CompletionScorer`` over its reward computer and tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from archon.data.rl_dataset import COMPLETION_IDS, PromptSample
from archon.rl.rewards import RewardComputer
from archon.rl.rollout_batch import Completion

ScoreFn = Callable[[Sequence[PromptSample], Sequence[Completion]], list[float]]
"""The reward of each completion (one per sample), given each completion's prompt; called on rank 0 only."""


class CompletionScorer:
    """Rank 0: rewards of completions, from their decoded text and the prompts' answers and extra fields.

    Reward functions get the text without special tokens and, as TRL passes them, the
    ``completion_ids`` (the stop token included when there was one): a text alone cannot tell
    EOS from padding or unknown-token ids, which a policy can learn to emit instead.
    """

    def __init__(self, rewards: RewardComputer, tokenizer: Any):
        self.rewards = rewards
        self.tokenizer = tokenizer

    def __call__(self, prompts: Sequence[PromptSample], completions: Sequence[Completion]) -> list[float]:
        texts = [self.tokenizer.decode(c.output_ids, skip_special_tokens=True) for c in completions]
        extra_keys = sorted({k for p in prompts for k in p.extra})
        extra = {k: [p.extra.get(k) for p in prompts] for k in extra_keys}
        extra[COMPLETION_IDS] = [list(c.output_ids) for c in completions]
        return self.rewards.compute([p.prompt for p in prompts], texts, [p.answer for p in prompts], **extra)
