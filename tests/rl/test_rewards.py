"""Reward functions and the crash-proof reward worker pool."""

import logging
import time

import pytest

from archon.rl.rewards import RewardComputer, exact_match_reward, extract_final_answer, get_reward_fn, math_reward


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("so the result is \\boxed{42}.", "42", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("Half of it: 0.5", "1/2", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        (
            "She sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars.\n#### 18",
            "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\nShe makes 9 * 2 = $18 every day.\n#### 18",
            1.0,
        ),
        ("Total is 1,000 apples", "#### 1000", 1.0),
        ("It makes 17 dollars", "#### 18", 0.0),
        ("\\boxed{x+1}", "\\boxed{1 + x}", 1.0),
        ("I do not know", "7", 0.0),
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward("q", completion, answer) == expected


def test_extract_final_answer_priority():
    assert extract_final_answer("3 then \\boxed{\\frac{a}{b}} then 5") == "\\frac{a}{b}"
    assert extract_final_answer("steps 1 2 #### 1,234") == "1234"
    assert extract_final_answer("x = 3, then y = -2.5.") == "-2.5"
    assert extract_final_answer("no digits") is None


def test_exact_match():
    assert exact_match_reward("p", "  Hello \n  World ", "hello world") == 1.0
    assert exact_match_reward("p", "hello", "world") == 0.0


def test_unknown_reward_names_explain_the_choices():
    with pytest.raises(ValueError, match="math, exact_match.*module:function"):
        get_reward_fn("mathh")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_reward_fn("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        get_reward_fn("reward_fns:nope")
    assert get_reward_fn("reward_fns:is_yes")("p", "yes", "a") is True


@pytest.fixture
def caplog_warnings(caplog):
    caplog.set_level(logging.WARNING, logger="archon.rl.rewards")
    return caplog


def test_user_function_by_path_in_workers_keeps_order():
    completions = ["x" * n for n in range(12)]
    with RewardComputer("reward_fns:length_reward", n_workers=2, timeout_s=10) as rc:
        out = rc.compute(["p"] * 12, completions, ["a"] * 12, bonus=[0.5 * i for i in range(12)])
        assert out == [n + 0.5 * n for n in range(12)]
        assert rc.compute(["p"] * 2, ["ab", "c"], ["a", "a"], bonus=1.0) == [3.0, 2.0]
        assert rc.counters.failures == 0 and rc.counters.calls == 14


def test_builtin_math_in_workers():
    with RewardComputer("math", n_workers=2, timeout_s=30) as rc:
        out = rc.compute(
            ["q"] * 4, ["\\boxed{42}", "0.5", "... #### 18", "\\boxed{7}"], ["42", "1/2", "Janet ... #### 18", "8"]
        )
    assert out == [1.0, 1.0, 1.0, 0.0]


def test_raising_function_gives_zero_and_warns(caplog_warnings):
    with RewardComputer("reward_fns:raises", n_workers=2, timeout_s=10) as rc:
        out = rc.compute(["p"] * 3, ["a", "boom", "b"], ["x"] * 3)
        assert out == [1.0, 0.0, 1.0]
        assert rc.counters.failures == 1 and rc.counters.restarts == 0
        assert "blew up" in rc.counters.failure_examples[0]
    assert any("sample 1" in r.message for r in caplog_warnings.records)


def test_os_exit_in_worker_gives_zero_and_pool_recovers(caplog_warnings):
    with RewardComputer("reward_fns:exits", n_workers=2, timeout_s=10) as rc:
        out = rc.compute(["p"] * 5, ["a", "exit", "b", "exit", "c"], ["x"] * 5)
        assert out == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert rc.counters.failures == 2 and rc.counters.restarts == 2
        # The replaced workers serve the next call.
        assert rc.compute(["p"] * 3, ["a", "b", "c"], ["x"] * 3) == [1.0, 1.0, 1.0]
        assert rc.metrics()["reward/failures"] == 2
    assert any("died" in r.message for r in caplog_warnings.records)


def test_segfault_in_worker_gives_zero():
    # One worker gets several samples ahead of its answers: those queued behind the crash are
    # scored by its replacement, not failed with it.
    with RewardComputer("reward_fns:segfaults", n_workers=1, timeout_s=10) as rc:
        assert rc.compute(["p"] * 6, ["a", "segv", "b", "c", "d", "e"], ["x"] * 6) == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
        assert rc.counters.failures == 1 and rc.counters.restarts == 1


def test_slow_function_is_cut_off_at_timeout():
    # 3 s: ample for the quick calls even on a loaded machine, far below the sleeper's 60 s.
    with RewardComputer("reward_fns:sleeps", n_workers=2, timeout_s=3.0) as rc:
        rc.compute(["p"], ["warm-up"], ["x"])  # workers booted; time only the real call
        start = time.monotonic()
        out = rc.compute(["p"] * 4, ["a", "slow", "b", "c"], ["x"] * 4)
        elapsed = time.monotonic() - start
        assert out == [1.0, 0.0, 1.0, 1.0]
        assert elapsed < 30  # cut off at timeout_s, not after the sleeper's 60 s
        assert rc.counters.timeouts == 1 and rc.counters.restarts == 1
        assert rc.compute(["p"] * 2, ["a", "b"], ["x"] * 2) == [1.0, 1.0]


def test_non_numeric_result_and_inline_mode():
    with RewardComputer("reward_fns:returns_none", n_workers=1, timeout_s=10) as rc:
        assert rc.compute(["p"], ["a"], ["x"]) == [0.0]
        assert rc.counters.failures == 1
    inline = RewardComputer("reward_fns:raises", n_workers=0)
    assert inline.compute(["p"] * 2, ["boom", "ok"], ["x"] * 2) == [0.0, 1.0]
    assert inline.counters.failures == 1
    booleans = RewardComputer("reward_fns:is_yes", n_workers=0)
    assert booleans.compute(["p"] * 2, ["yes", "no"], ["x"] * 2) == [1.0, 0.0]


def test_mismatched_lengths_are_rejected():
    rc = RewardComputer("exact_match", n_workers=0)
    with pytest.raises(ValueError, match="one entry per sample"):
        rc.compute(["p"], ["a", "b"], ["x", "y"])


def test_every_kind_of_failure_is_logged_with_its_index_counted_and_scored_zero(caplog_warnings):
    completions = ["ok", "raise", "hang", "text", "nan", "ok"]
    with RewardComputer("reward_fns:misbehaves", n_workers=2, timeout_s=1.0, max_failure_frac=1.0) as rc:
        assert rc.compute(["p"] * 6, completions, ["x"] * 6) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        metrics = rc.metrics()
    assert metrics["reward/failures"] == 3 and metrics["reward/timeouts"] == 1
    assert metrics["reward/failed_frac"] == pytest.approx(4 / 6)
    messages = [r.getMessage() for r in caplog_warnings.records]
    for index, why in [(1, "KeyError"), (2, "timeout_s"), (3, "'1.0' (str), not a number"), (4, "not finite")]:
        assert any(f"sample {index} " in m and why in m for m in messages), (index, messages)


def test_more_failures_than_max_failure_frac_stop_with_one_sentence():
    from archon.rl.rewards import RewardError

    rc = RewardComputer("reward_fns:misbehaves", n_workers=0, max_failure_frac=0.5)
    assert rc.compute(["p"] * 4, ["raise", "ok", "text", "ok"], ["x"] * 4) == [
        0.0,
        1.0,
        0.0,
        1.0,
    ]  # 2 of 4: at the limit
    with pytest.raises(RewardError) as info:
        rc.compute(["p"] * 4, ["raise", "ok", "text", "nan"], ["x"] * 4)
    msg = str(info.value)
    assert "3 of 4 reward calls failed" in msg and "reward.max_failure_frac=0.5" in msg and "\n" not in msg
    assert "sample 0: KeyError" in msg and "reward_fns:misbehaves" in msg
    with pytest.raises(ValueError, match="max_failure_frac = 2"):
        RewardComputer("exact_match", n_workers=0, max_failure_frac=2)
