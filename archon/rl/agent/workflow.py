"""The agent workflow interface: a user's async function, loaded by name, run as one recorded episode.

An agent is a plain async function in the user's own module, named in config as ``"package.module:function"``::

    async def solve(sample: dict, client: openai.AsyncOpenAI, **kw) -> float | list[float]:
        ...  # chat with client.chat.completions.create(model=..., messages=...), call tools, score the result
        return reward  # the episode's reward, or one reward per request made
        # or (reward, {"tool_ok": 1.0}): the step metrics agent/<name> average what episodes report

``run_episode`` gives it an ``AsyncOpenAI`` client bound to one episode of a ``RecordingProxy`` (which records the
exact token ids every request sent and sampled), awaits it and returns the episode's ``Trajectory`` with the
reward(s).  A workflow that raises or runs past ``timeout_s`` does not stop training: its episode ends with
``truncation`` 'error' or 'timeout' (a limit the proxy enforced first keeps its own reason, 'max_turns' or
'max_tokens') and reward 0.0, and a warning is logged.  A workflow that returns something that is not a reward is
a bug in every episode, so that raises ``ValueError``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import pkgutil
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

from archon.config import ConfigError
from archon.rl.agent.proxy import RecordingProxy
from archon.rl.agent.tool_chat import tool_chat
from archon.rl.agent.trajectory import Trajectory

logger = logging.getLogger(__name__)

TIMEOUT = "timeout"
"""Truncation reason: the workflow ran past its timeout and was cancelled."""
ERROR = "error"
"""Truncation reason: the workflow raised an exception."""
USAGE = (
    "name a built-in workflow ('tool_chat') or an async function 'package.module:function' defined as "
    "async def solve(sample, client, **kw)"
)


Workflow = Callable[..., Awaitable[Any]]
"""An agent: ``async def solve(sample: dict, client: openai.AsyncOpenAI, **kw)`` chats through ``client`` about
``sample`` and returns the episode's reward or one reward per request it made, optionally paired with a dict of
the episode's metrics: ``(reward, {"tool_ok": 1.0})``."""


BUILTIN_WORKFLOWS: dict[str, Workflow] = {"tool_chat": tool_chat}
"""Workflows a config names without an import path (``archon.rl.agent.tool_chat``)."""


def load_workflow(name: str | Workflow) -> Workflow:
    """The built-in workflow or the async function ``name`` ('package.module:function') names, or ``name`` itself
    when it is one."""
    fn: Any = name
    if isinstance(name, str) and name in BUILTIN_WORKFLOWS:
        return BUILTIN_WORKFLOWS[name]
    if isinstance(name, str):
        if ":" not in name:
            raise ConfigError(f"agent workflow '{name}' has no ':'; {USAGE}")
        try:
            fn = pkgutil.resolve_name(name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(
                f"agent workflow '{name}' cannot be loaded ({exc}); make it importable and {USAGE}"
            ) from None
    # An async function, a functools.partial of one, or an object with an async __call__.
    if not callable(fn) or not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
        raise ConfigError(f"agent workflow {name!r} is not an async function; {USAGE}")
    return cast(Workflow, fn)


async def run_episode(
    workflow: Workflow,
    sample: Mapping[str, Any],
    proxy: RecordingProxy,
    *,
    timeout_s: float | None = None,
    max_turns: int | None = None,
    max_total_tokens: int | None = None,
    seed: int | None = None,
    **kw: Any,
) -> Trajectory:
    """Run ``workflow`` on ``sample`` as one episode of ``proxy`` (extra ``kw`` go to the workflow) and return
    its trajectory with the reward(s); ``seed`` pins its turns' sampling seeds; see the module docstring for
    failures."""
    eid = proxy.open_episode(max_turns=max_turns, max_total_tokens=max_total_tokens, seed=seed)
    client = proxy.openai_client(eid)
    result: Any = None
    failure: str | None = None
    try:
        result = await asyncio.wait_for(workflow(dict(sample), client, **kw), timeout_s)
    except TimeoutError:
        failure = TIMEOUT
        logger.warning("agent episode %s: the workflow ran past its timeout of %s s", eid, timeout_s)
    except Exception as exc:  # whatever the user's agent raises costs only this episode
        failure = ERROR
        logger.warning("agent episode %s: the workflow raised %s: %s", eid, type(exc).__name__, exc, exc_info=True)
    finally:
        traj = proxy.close_episode(eid)
    if failure is not None:
        if traj.truncation is None:
            traj.truncation = failure
        traj.reward = 0.0
        return traj
    _set_rewards(traj, result, workflow)
    return traj


def _set_rewards(traj: Trajectory, result: Any, workflow: Workflow) -> None:
    """Store the workflow's return value as the episode's reward or its per-turn rewards (and its metrics)."""
    name = getattr(workflow, "__qualname__", repr(workflow))
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        result, metrics = result
        traj.metrics = {str(k): _to_reward(v, f"{name} (metric {k!r})") for k, v in metrics.items()}
    if isinstance(result, (list, tuple)):
        rewards = [_to_reward(r, name) for r in result]
        if len(rewards) != traj.n_turns:
            raise ValueError(
                f"agent workflow {name} returned {len(rewards)} per-turn rewards for an episode of {traj.n_turns} "
                "requests; return one reward per request, or one float for the episode"
            )
        traj.turn_rewards = rewards
    else:
        traj.reward = _to_reward(result, name)


def _to_reward(value: Any, name: str) -> float:
    """``value`` as a finite float, or a ValueError naming the workflow."""
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    raise ValueError(f"agent workflow {name} returned {value!r}; return a finite float or a list of them")
