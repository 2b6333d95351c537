"""The built-in agent workflow: a chat with tools, up to a number of calls, scored by a reward function.

``rollout.workflow = "tool_chat"`` runs each sample as this conversation: the sample's ``messages`` (a plain prompt
becomes one user message) with the tools' JSON schemas, the policy's reply, and while the reply calls tools (in the
chat template's ``<tool_call>{...}</tool_call>`` format, Hermes / Qwen), each call run (with a timeout) and its
result appended as a tool message, then the policy asked again.  The episode ends when a reply calls no tool, a
reply's calls cannot be parsed or name no such tool, or ``max_calls`` replies called tools.  The reward is
``reward_fn(prompt, final reply's text, answer, **sample fields)`` (a built-in name or 'package.module:function',
as ``reward.fn``); a failed call is answered with an error message, as tool frameworks do, and the policy goes on.

Keyword arguments (``rollout.workflow_kwargs``): ``tools`` (names of ``BUILTIN_TOOLS`` or 'package.module:function'
specs, default ``["calculator"]``), ``reward_fn`` (default 'math'), ``max_calls`` (default 4), ``tool_timeout_s``
(default 10).  The episode's metrics (step metrics ``agent/<name>``, means over episodes) are its tool-call outcomes
(``tool_ok``, ``tool_timeout``, ``tool_exception``, ``tool_garbage``, ``tool_parse_error``, ``tool_unknown``) and
``tool_calls``, the replies that called tools.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, cast

import openai

from archon.rl.agent.tools import ToolMetrics, load_tools, parse_tool_calls, run_tool_call, tools_schema
from archon.rl.rewards import get_reward_fn


async def tool_chat(
    sample: dict[str, Any],
    client: openai.AsyncOpenAI,
    *,
    tools: Sequence[str] = ("calculator",),
    reward_fn: str = "math",
    max_calls: int = 4,
    tool_timeout_s: float = 10.0,
) -> tuple[float, dict[str, float]]:
    """One episode of the chat with ``tools`` (see the module docstring): its reward and metrics."""
    available = load_tools(tools)
    schema = tools_schema(available)
    score = get_reward_fn(reward_fn)
    messages: list[Any] = [dict(m) for m in sample["messages"]]
    outcomes = ToolMetrics()
    text, calls = "", 0
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=cast(Any, schema))
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})  # exactly as answered: the recorded history
        parsed = parse_tool_calls(text, available)
        if parsed.error is not None:
            outcomes.record(parsed.error_kind or "parse_error")
            break
        if not parsed.tool_calls or calls >= max_calls:
            break
        calls += 1
        for call in parsed.tool_calls:
            fn = call["function"]
            result = await run_tool_call(available[fn["name"]], json.loads(fn["arguments"]), tool_timeout_s)
            outcomes.record(result.kind)
            messages.append({"role": "tool", "content": result.content if result.error is None else result.error})
    extra = {k: v for k, v in sample.items() if k not in ("prompt", "answer")}
    reward = float(score(str(sample.get("prompt", "")), parsed.content or text, str(sample.get("answer", "")), **extra))
    metrics = {kind.replace("/", "_"): n for kind, n in outcomes.as_dict().items()}  # tool_ok, tool_timeout, ...
    metrics["tool_calls"] = float(calls)
    return reward, metrics
