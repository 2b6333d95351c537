"""Completions -> the token-aligned RL batch, and PPO minibatch splits."""

from __future__ import annotations

import pytest
import torch

from archon.rl.rollout_batch import Completion, build_rollout_batch, ppo_minibatches, split_minibatches
from archon.rl.rollout_strategy import rollout_seed


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


def _numbered_batch(rows: int) -> dict:
    ids = torch.arange(rows).unsqueeze(1).repeat(1, 3) + 1
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(rows, 3, dtype=torch.long),
        "loss_mask": torch.ones(rows, 3),
        "rewards": torch.arange(rows, dtype=torch.float32),
    }


def test_ppo_epochs_and_seeded_shuffle():
    batch = _numbered_batch(6)

    def rows_of(mbs):
        return [mb["rewards"].long().tolist() for mb in mbs]

    plain = rows_of(ppo_minibatches(batch, 2, epochs=2))
    assert plain == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]  # contiguous, the same every pass
    shuffled = rows_of(ppo_minibatches(batch, 2, epochs=3, shuffle=True, seed=7))
    passes = [shuffled[i] + shuffled[i + 1] for i in range(0, 6, 2)]
    assert all(sorted(p) == list(range(6)) for p in passes)  # every pass covers every row once
    assert len({tuple(p) for p in passes}) == 3  # and each pass has an order of its own
    assert rows_of(ppo_minibatches(batch, 2, epochs=3, shuffle=True, seed=7)) == shuffled  # a function of the seed
    assert rows_of(ppo_minibatches(batch, 2, epochs=3, shuffle=True, seed=8)) != shuffled
    # Rows move with all their keys.
    for mb in ppo_minibatches(batch, 3, shuffle=True, seed=1):
        assert (mb["input_ids"][:, 0] - 1).tolist() == mb["rewards"].long().tolist()
    with pytest.raises(ValueError, match="ppo_epochs = 0"):
        list(ppo_minibatches(batch, 2, epochs=0))


def test_rollout_seeds_depend_on_seed_step_and_index_only():
    seeds = {rollout_seed(1, s, i) for s in range(1, 20) for i in range(64)}
    assert len(seeds) == 19 * 64  # distinct per (step, sample)
    assert rollout_seed(1, 3, 5) == rollout_seed(1, 3, 5) != rollout_seed(2, 3, 5)
    assert all(0 <= x < 2**31 for x in seeds)
