"""Agent trajectories -> the RL batch: the single-turn path as reference, multi-turn masks, reward placement."""

from __future__ import annotations

import pytest
import torch

from archon.rl.advantages import token_rewards
from archon.rl.agent.agent_batch import agent_metrics, build_agent_batch
from archon.rl.agent.trajectory import Segment, Trajectory, Turn
from archon.rl.rollout_batch import FRESH_MASK, TURN_REWARDS, Completion, build_rollout_batch


def _completions() -> list[Completion]:
    return [
        Completion([5, 6, 7], [8, 2], [-0.5, -0.25], "stop", output_versions=[3, 4]),
        Completion([9], [10, 11, 12], [-1.0, -2.0, -3.0], "length", output_versions=[4, 4, 4]),
        Completion([3, 4], [], [], "abort", output_versions=[]),
        Completion([1, 2, 3, 4, 5, 6], [7], [-0.75], "stop"),
    ]


def _one_turn(c: Completion, reward: float) -> Trajectory:
    return Trajectory([Turn.from_completion([Segment(c.prompt_ids, "prompt")], c)], reward=reward)


def test_one_turn_trajectories_give_the_single_turn_batch():
    completions, rewards = _completions(), [1.0, 0.0, 0.5, -1.0]
    for fresh in (None, 4):
        ref = build_rollout_batch(completions, rewards, pad_token_id=99, fresh_version=fresh)
        got = build_agent_batch([_one_turn(c, r) for c, r in zip(completions, rewards)], 99, fresh)
        assert got.keys() == ref.keys()
        for key in ref:
            assert got[key].dtype == ref[key].dtype, key
            assert torch.equal(got[key], ref[key]), key


def _episode(turn_rewards: list[float] | None = None, reward: float | None = None) -> Trajectory:
    return Trajectory(
        [
            Turn([Segment([5, 6], "prompt")], [7, 3], [-0.1, -0.2], "stop", [2, 3]),
            Turn([Segment([9, 10], "tool")], [11, 12, 3], [-0.3, -0.4, -0.5], "stop", [3, 3, 3]),
        ],
        reward=reward,
        turn_rewards=turn_rewards,
    )


def test_multi_turn_rows_and_per_turn_rewards():
    short = Trajectory([Turn([Segment([4], "prompt")], [8], [-0.9], "length", [3])], turn_rewards=[2.0])
    batch = build_agent_batch([_episode(turn_rewards=[0.5, 1.0]), short], pad_token_id=0, fresh_version=3)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 3, 9, 10, 11, 12, 3], [4, 8, 0, 0, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 9, [1, 1] + [0] * 7]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 1, 1, 1], [0, 1] + [0] * 7]
    lp = batch["logprobs"].tolist()
    assert lp[0] == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, -0.5]) and lp[1][:2] == pytest.approx([0, -0.9])
    assert batch[FRESH_MASK].tolist() == [[0, 0, 0, 1, 0, 0, 1, 1, 1], [0, 1] + [0] * 7]
    # Each turn's reward on its last sampled id (hand-placed); the row reward is their sum.
    assert batch[TURN_REWARDS].tolist() == [[0, 0, 0, 0.5, 0, 0, 0, 0, 1.0], [0, 2.0] + [0] * 7]
    assert batch["rewards"].tolist() == [1.5, 2.0]
    assert batch["seq_no_eos_mask"].tolist() == [False, True]


def test_episode_reward_lands_where_the_advantages_put_sequence_rewards():
    eps = [_episode(reward=1.5), _episode(turn_rewards=[0.0, 0.25])]
    batch = build_agent_batch(eps)
    # token_rewards (the advantages' placement of sequence rewards) puts each on the last loss token.
    assert torch.equal(batch[TURN_REWARDS], token_rewards(batch["rewards"], batch["loss_mask"]))
    assert batch[TURN_REWARDS][0].nonzero().flatten().tolist() == [8]


def test_an_unsampled_turn_credits_the_sampled_id_before_it():
    first, last = _episode().turns
    aborted = Turn([Segment([13], "user")], [], [], "abort")
    batch = build_agent_batch([Trajectory([first, aborted, last], turn_rewards=[1.0, 2.0, 4.0])])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 3, 13, 9, 10, 11, 12, 3]]
    assert batch[TURN_REWARDS].tolist() == [[0, 0, 0, 3.0, 0, 0, 0, 0, 0, 4.0]]
    at_start = build_agent_batch(
        [Trajectory([Turn([Segment([1], "prompt")], [], [], "abort"), last], turn_rewards=[2.0, 4.0])]
    )
    assert at_start[TURN_REWARDS].tolist() == [[0, 0, 0, 0, 0, 6.0]]  # nothing before it: the first sampled id


def test_errors_name_the_trajectory_and_metrics():
    with pytest.raises(ValueError, match="no trajectories"):
        build_agent_batch([])
    with pytest.raises(ValueError, match="trajectory 1: a trajectory needs exactly one of reward"):
        build_agent_batch([_episode(reward=1.0), _episode()])
    cut = _episode(reward=0.0)
    cut.truncation = "max_turns"
    assert agent_metrics([_episode(reward=1.0), cut, _one_turn(_completions()[0], 0.0)]) == {
        "agent/turns_mean": pytest.approx(5 / 3),
        "agent/turns_max": 2.0,
        "agent/truncated_frac": pytest.approx(1 / 3),
    }


def test_workflow_metrics_average_over_the_episodes_that_report_them():
    a, b, c = _episode(reward=1.0), _episode(reward=0.0), _episode(reward=0.5)
    a.metrics, b.metrics = {"tool_ok": 1.0, "calls": 3.0}, {"tool_ok": 0.0}
    metrics = agent_metrics([a, b, c])
    assert metrics["agent/tool_ok"] == 0.5 and metrics["agent/calls"] == 3.0  # c reports neither
