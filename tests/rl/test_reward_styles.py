"""Reward functions in TRL's style run through the reward pool; unusable ones are refused before start."""

from __future__ import annotations

import re

import pytest

from archon.config import ConfigError
from archon.config.reward_check import check_reward_fn
from archon.rl.rewards import RewardComputer, get_reward_fn


def test_trl_style_reward_runs_in_worker_processes():
    prompts, completions, answers = ["p1", "p2", "p3"], ["abc 7", "xy", "the answer is 12"], ["7", "3", "12"]
    # Hand-computed: len(completion) + 100 when the answer is in it.
    expected = [5.0 + 100.0, 2.0, 16.0 + 100.0]
    with RewardComputer("trl_reward_fns:trl_length", n_workers=1, timeout_s=30, max_failure_frac=0.0) as rc:
        got = rc.compute(prompts, completions, answers, completion_ids=[[1], [2], [3]], topic=["a", "b", "c"])
    assert got == expected
    assert rc.metrics()["reward/failures"] == 0


def test_trl_shapes_with_prompts_or_without_kwargs_are_called_inline():
    rc = RewardComputer("trl_reward_fns:trl_prompt_aware", n_workers=0, max_failure_frac=0.0)
    assert rc.compute(["hi", "yo"], ["hi there", "nope"], ["", ""], completion_ids=[[1], [2]]) == [1.0, 0.0]
    only = get_reward_fn("trl_reward_fns:trl_no_kwargs")
    assert only("p", "banana", "x", completion_ids=[5], extra_field=1) == 3.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("trl_reward_fns:two_args", "cannot be called as fn(prompt, completion, answer"),
        ("trl_reward_fns:needs_reference", "reference would be missing"),
        ("trl_reward_fns:NOT_CALLABLE", "is not callable"),
        ("trl_reward_fns:nope", "has no attribute 'nope'"),
        ("mathh", "unknown reward function 'mathh'"),
    ],
)
def test_unusable_reward_functions_are_refused_by_the_check_and_the_pool(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_reward_fn(spec)
    with pytest.raises(ConfigError, match=re.escape(message)):
        RewardComputer(spec, n_workers=0)


def test_the_check_says_which_convention_it_found():
    assert "TRL's" in check_reward_fn("trl_reward_fns:trl_length")
    assert "fn(prompt, completion, answer" in check_reward_fn("reward_fns:token_count")
    assert "built-in" in check_reward_fn("math")
