"""DAPO dynamic sampling: groups with equal rewards are dropped and the batch is refilled."""

from __future__ import annotations

import pytest

from archon.rl.dynamic_filter import collect_mixed_groups, mixed_groups


def test_mixed_groups():
    assert mixed_groups([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], 2) == [False, True, False]
    with pytest.raises(ValueError, match="groups of 2"):
        mixed_groups([1.0, 0.0, 1.0], 2)


class Rounds:
    """Scripted rollout rounds: each gives 3 groups of 2; completions are (round, index) labels."""

    def __init__(self, rewards_per_round):
        self.rewards_per_round = rewards_per_round
        self.calls = []

    def __call__(self, round_idx):
        self.calls.append(round_idx)
        rewards = self.rewards_per_round[round_idx]
        return [(round_idx, i) for i in range(len(rewards))], rewards, {"rollout_time_s": 1.0}


def test_refills_until_the_batch_has_enough_mixed_groups():
    draw = Rounds(
        [
            [1, 1, 0, 1, 0, 0],  # one mixed group (the 2nd)
            [1, 0, 1, 1, 1, 0],  # groups 1 and 3 mixed
            [0, 1, 0, 1, 0, 1],  # never needed
        ]
    )
    completions, rewards, info = collect_mixed_groups(draw, group_size=2, max_rounds=10)
    assert draw.calls == [0, 1]
    # The 3 mixed groups in draw order; the batch keeps the first round's size.
    assert completions == [(0, 2), (0, 3), (1, 0), (1, 1), (1, 4), (1, 5)]
    assert rewards == [0, 1, 1, 0, 1, 0]
    assert info["dynamic_filter/rounds"] == 2 and info["dynamic_filter/refills"] == 1
    assert info["dynamic_filter/dropped_groups"] == 3 and info["dynamic_filter/taken_back_groups"] == 0
    assert info["dynamic_filter/surplus_groups"] == 0
    assert info["rollout_time_s"] == 2.0  # timings add up over rounds
    assert info["dynamic_filter/reward_mean_generated"] == pytest.approx(7 / 12)


def test_surplus_groups_of_the_last_round_are_discarded():
    draw = Rounds([[1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0]])
    completions, _, info = collect_mixed_groups(draw, group_size=2)
    assert completions == [(0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert info["dynamic_filter/surplus_groups"] == 1


def test_bound_completes_the_batch_with_dropped_groups():
    draw = Rounds([[1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 1]])
    completions, rewards, info = collect_mixed_groups(draw, group_size=2, max_rounds=2)
    assert draw.calls == [0, 1]
    # One mixed group, then the first two dropped groups in draw order.
    assert completions == [(0, 2), (0, 3), (0, 0), (0, 1), (0, 4), (0, 5)]
    assert rewards == [0, 1, 1, 1, 0, 0]
    assert info["dynamic_filter/taken_back_groups"] == 2 and info["dynamic_filter/dropped_groups"] == 3
