"""Agent episodes as recorded token ids: flattening, masks, alignment, and the prompt-prefix invariant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archon.rl.agent.agent_batch import build_agent_batch
from archon.rl.agent.trajectory import SAMPLED_ROLE, Segment, Trajectory, Turn
from archon.rl.rollout_batch import Completion


def _two_turns() -> Trajectory:
    return Trajectory(
        [
            Turn([Segment([5, 6], "prompt")], [7, 8, 3], [-0.1, -0.2, -0.3], "stop", [4, 4, 5]),
            Turn([Segment([9], "template"), Segment([10, 11], "tool")], [12, 3], [-0.4, -0.5], "stop", [5, 5]),
        ],
        reward=1.0,
    )


def test_tokens_concatenate_turns_with_mask_on_sampled_ids_only():
    tok = _two_turns().tokens()
    assert tok.input_ids == [5, 6, 7, 8, 3, 9, 10, 11, 12, 3]
    assert tok.loss_mask == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
    assert tok.logprobs == [0.0, 0.0, -0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5]
    assert tok.versions == [-1, -1, 4, 4, 5, -1, -1, -1, 5, 5]
    s = SAMPLED_ROLE
    assert tok.roles == ["prompt", "prompt", s, s, s, "template", "tool", "tool", s, s]
    assert _two_turns().turn_end_positions() == [4, 9]


def test_trained_ids_are_the_generated_ids_turn_by_turn():
    # An agent loop: each request's prompt is Trajectory.ids() plus the new context; the server samples.
    contexts = [
        [Segment([5, 6], "prompt")],
        [Segment([9], "template"), Segment([10, 11], "tool")],
        [Segment([13], "user")],
    ]
    outputs = [[7, 8, 3], [12, 3], [14, 15]]
    traj = Trajectory()
    sent = []
    for ctx, out in zip(contexts, outputs):
        prompt = traj.ids() + [t for s in ctx for t in s.ids]
        sent.append(prompt)
        traj.add_turn(ctx, Completion(prompt, out, [-1.0] * len(out), "stop" if out[-1] == 3 else "length"))
    tok = traj.tokens()
    pos = 0
    for prompt, out in zip(sent, outputs):
        assert tok.input_ids[: len(prompt)] == prompt  # every prompt is a prefix of the trained row
        pos = len(prompt)
        assert tok.input_ids[pos : pos + len(out)] == out  # the sampled ids follow it, unchanged
        assert tok.loss_mask[pos : pos + len(out)] == [1] * len(out)
    assert sum(tok.loss_mask) == sum(len(o) for o in outputs)
    assert traj.truncated and traj.n_turns == 3  # the last turn hit the length limit


def test_a_prompt_that_is_not_the_recorded_prefix_is_refused():
    traj = Trajectory()
    traj.add_turn([Segment([5, 6], "prompt")], Completion([5, 6], [7, 3], [-1.0, -1.0], "stop"))
    # The conversation re-tokenised differently ([5, 66] instead of [5, 6, 7, 3]) breaks the invariant.
    with pytest.raises(ValueError, match="first differs at token 1"):
        traj.add_turn([Segment([9], "tool")], Completion([5, 66, 9], [3], [-1.0], "stop"))
    with pytest.raises(ValueError, match="lengths differ"):
        traj.add_turn([Segment([9], "tool")], Completion([5, 6, 7, 3], [3], [-1.0], "stop"))
    assert traj.n_turns == 1


def test_rewards_truncation_and_bad_turns():
    traj = _two_turns()
    assert traj.episode_reward() == 1.0 and not traj.truncated
    traj.truncation = "max_turns"
    assert traj.truncated
    both = Trajectory(_two_turns().turns, reward=1.0, turn_rewards=[0.0, 1.0])
    with pytest.raises(ValueError, match="exactly one of reward"):
        both.episode_reward()
    assert Trajectory(_two_turns().turns, turn_rewards=[0.25, 0.5]).episode_reward() == 0.75
    with pytest.raises(ValueError, match="1 turn_rewards for 2 turns"):
        Trajectory(_two_turns().turns, turn_rewards=[0.5]).episode_reward()
    with pytest.raises(ValueError, match="2 sampled ids but 1 logprobs"):
        Turn([], [1, 2], [-1.0], "stop")
    with pytest.raises(ValueError, match="2 sampled ids but 3 versions"):
        Turn([], [1, 2], [-1.0, -1.0], "stop", [1, 1, 1])
    with pytest.raises(ValueError, match="first turn has an empty prompt"):
        Trajectory([Turn([], [1], [-1.0], "stop")], reward=0.0).tokens()
    with pytest.raises(ValueError, match="no turns"):
        Trajectory(reward=0.0).tokens()


def test_routing_of_each_id_comes_from_the_first_request_that_ran_it():
    traj = _two_turns()  # ids [5, 6, 7, 8, 3 | 9, 10, 11, 12, 3]: turn 0 ran 4 of them, turn 1 ran 9
    assert traj.routed_experts() is None and traj.sampled_versions() == [4, 4, 5, 5, 5]
    # Expert ids 100 + position (turn 0's request) and 200 + position (turn 1's), 2 layers, top-1.
    traj.turns[0].routed_experts = np.array([[[100 + p], [100 + p]] for p in range(4)])
    traj.turns[1].routed_experts = np.array([[[200 + p], [200 + p]] for p in range(9)])
    routed = traj.routed_experts()
    assert routed.shape == (9, 2, 1)
    # Turn 1's prefill ran turn 0's last sampled id (position 4) first; the last id (9) is never run.
    assert routed[:, 0, 0].tolist() == [100, 101, 102, 103, 204, 205, 206, 207, 208]
    traj.turns[1].routed_experts = None
    with pytest.raises(ValueError, match="turn 1 has no routed experts while others do"):
        traj.routed_experts()
    traj.turns[1].routed_experts = np.zeros((5, 2, 1))
    with pytest.raises(ValueError, match="turn 1's routed experts cover 5 ids, expected 9"):
        traj.routed_experts()
    traj.turns[1].output_versions = None
    assert traj.sampled_versions() is None


def test_the_batch_carries_each_episode_routing_token_aligned():
    a, b = _two_turns(), _two_turns()
    b.turns = b.turns[:1]  # 5 ids: one turn
    a.turns[0].routed_experts = np.full((4, 2, 1), 1)
    a.turns[1].routed_experts = np.full((9, 2, 1), 2)
    b.turns[0].routed_experts = np.full((4, 2, 1), 3)
    batch = build_agent_batch([a, b])
    routed = batch["routed_experts"]
    assert routed.shape == (2, 10, 2, 1) and routed.dtype == torch.int16
    assert routed[0, :, 0, 0].tolist() == [1, 1, 1, 1, 2, 2, 2, 2, 2, -1]
    assert routed[1, :, 0, 0].tolist() == [3, 3, 3, 3, -1, -1, -1, -1, -1, -1]
