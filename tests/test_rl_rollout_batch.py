"""Completions -> the token-aligned RL batch, and PPO minibatch splits."""

from __future__ import annotations

import pytest
import torch

from archon.rl.rollout_batch import Completion, build_rollout_batch, split_minibatches
from archon.rl.trainer import rollout_seed


def _completions() -> list[Completion]:
    return [
        Completion([5, 6, 7], [8, 2], [-0.5, -0.25], "stop"),
        Completion([9], [10, 11, 12], [-1.0, -2.0, -3.0], "length"),
        Completion([3, 4], [], [], "abort"),
    ]


def test_batch_is_token_aligned_with_behaviour_logprobs_on_completion_tokens():
    batch = build_rollout_batch(_completions(), [1.0, 0.0, 0.5], pad_token_id=99)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 2], [9, 10, 11, 12, 99], [3, 4, 99, 99, 99]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]]
    assert batch["logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25], [0, -1.0, -2.0, -3.0, 0], [0] * 5]
    assert batch["rewards"].tolist() == [1.0, 0.0, 0.5]
    assert batch["seq_no_eos_mask"].tolist() == [False, True, True]
    assert batch["loss_mask"].dtype == torch.float32 and batch["logprobs"].dtype == torch.float32


def test_bad_completions_are_reported():
    bad = [Completion([1], [2, 3], [-1.0], "stop")]
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        build_rollout_batch(bad, [0.0])
    with pytest.raises(ValueError, match="one reward per completion"):
        build_rollout_batch(_completions(), [0.0])


def test_minibatches_are_contiguous_trimmed_and_skip_empty():
    batch = build_rollout_batch(_completions(), [1.0, 0.0, 0.5])
    one = split_minibatches(batch, 1)
    assert len(one) == 1 and torch.equal(one[0]["input_ids"], batch["input_ids"])
    three = split_minibatches(batch, 3)
    # The third row has no loss token: nothing to step on, so it is left out.
    assert len(three) == 2
    assert three[0]["input_ids"].tolist() == [[5, 6, 7, 8, 2]]
    assert three[1]["input_ids"].tolist() == [[9, 10, 11, 12]] and three[1]["rewards"].tolist() == [0.0]
    with pytest.raises(ValueError, match="ppo_n_minibatches = 4"):
        split_minibatches(batch, 4)


def test_rollout_seeds_depend_on_seed_step_and_index_only():
    seeds = {rollout_seed(1, s, i) for s in range(1, 20) for i in range(64)}
    assert len(seeds) == 19 * 64  # distinct per (step, sample)
    assert rollout_seed(1, 3, 5) == rollout_seed(1, 3, 5) != rollout_seed(2, 3, 5)
    assert all(0 <= x < 2**31 for x in seeds)
