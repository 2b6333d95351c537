"""Agent workflows: loaded from 'module:function' with one-sentence errors, and run as episodes whose failures
(an exception, a timeout) end the episode with a reason instead of crashing, while bad rewards raise."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import pytest

from archon.config import ConfigError
from archon.rl.agent import ERROR, TIMEOUT, RecordingProxy, Trajectory, load_workflow, run_episode
from archon.rollout.client import RolloutClient


async def returns(sample: dict[str, Any], client: Any, value: Any = 1.0) -> Any:
    """Returns ``value`` without asking the policy anything, after checking it got a client of its episode."""
    assert str(client.base_url).rstrip("/").endswith("/v1") and "/episodes/" in str(client.base_url)
    return sample.get("value", value)


async def raises(sample: dict[str, Any], client: Any) -> float:
    raise KeyError("no such tool")


async def hangs(sample: dict[str, Any], client: Any) -> float:
    await asyncio.Event().wait()  # never set
    return 1.0


def not_async(sample: dict[str, Any], client: Any) -> float:
    return 1.0


def _run(workflow: Any, sample: dict[str, Any], **kw: Any) -> Trajectory:
    """``workflow`` as one episode of a proxy whose servers are never asked (the workflows here make no request)."""

    async def main() -> Trajectory:
        with RolloutClient(["127.0.0.1:9"], retries=0) as client:
            async with RecordingProxy(client, tokenizer=None) as proxy:
                return await run_episode(workflow, sample, proxy, **kw)

    return asyncio.run(main())


def test_load_workflow_resolves_module_function():
    assert load_workflow(f"{__name__}:returns") is returns
    assert load_workflow(returns) is returns
    partial = functools.partial(returns, value=2.0)
    assert load_workflow(partial) is partial


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("returns", "agent workflow 'returns' has no ':'"),
        ("no_such_module_xyz:solve", "agent workflow 'no_such_module_xyz:solve' cannot be loaded"),
        (f"{__name__}:missing", f"agent workflow '{__name__}:missing' cannot be loaded"),
        (f"{__name__}:not_async", "is not an async function"),
    ],
)
def test_load_workflow_errors_are_one_sentence(name, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_workflow(name)
    assert "async def solve(sample, client, **kw)" in str(info.value) and "\n" not in str(info.value)


def test_episode_reward_and_kwargs_reach_the_workflow():
    traj = _run(returns, {}, value=0.25)
    assert traj.reward == 0.25 and traj.turn_rewards is None and traj.truncation is None and traj.n_turns == 0
    assert _run(returns, {"value": []}).turn_rewards == []  # per-turn rewards: one per request (none here)


def test_raising_workflow_ends_with_error(caplog):
    with caplog.at_level(logging.WARNING, logger="archon.rl.agent.workflow"):
        traj = _run(raises, {})
    assert traj.truncation == ERROR and traj.reward == 0.0 and traj.n_turns == 0
    assert "the workflow raised KeyError" in caplog.text


def test_hanging_workflow_ends_with_timeout():
    traj = _run(hangs, {}, timeout_s=0.2)
    assert traj.truncation == TIMEOUT and traj.reward == 0.0


@pytest.mark.parametrize(
    ("value", "message"),
    [("1.0", "returned '1.0'; return a finite float"), (float("nan"), "returned nan"), ([1.0], "1 per-turn rewards")],
)
def test_bad_rewards_raise(value, message):
    with pytest.raises(ValueError, match=message):
        _run(returns, {"value": value})


def test_a_workflow_may_report_episode_metrics():
    traj = _run(returns, {"value": (0.5, {"tool_ok": 1, "calls": 2.0})})
    assert traj.reward == 0.5 and traj.metrics == {"tool_ok": 1.0, "calls": 2.0}
    with pytest.raises(ValueError, match="metric 'tool_ok'"):
        _run(returns, {"value": (0.5, {"tool_ok": "yes"})})
