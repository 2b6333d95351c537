"""The built-in ``tool_chat`` workflow against a scripted policy: tool calls run and answered as tool messages,
the conversation sent back as recorded, the final reply scored, outcomes counted, the call limit kept."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from archon.rl.agent import load_workflow
from archon.rl.agent.tool_chat import tool_chat


def call(expression: str, name: str = "calculator") -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': {'expression': expression}})}\n</tool_call>"


class ScriptedPolicy:
    """Stands in for ``openai.AsyncOpenAI``: answers ``client.chat.completions.create`` with scripted replies."""

    def __init__(self, replies: list[str]):
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **request: Any) -> Any:
        self.requests.append(json.loads(json.dumps(request)))  # a copy, as it went over the wire
        message = SimpleNamespace(content=self.replies.pop(0))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def run(replies: list[str], answer: str = "41", **kw: Any) -> tuple[tuple[float, dict[str, float]], ScriptedPolicy]:
    policy = ScriptedPolicy(replies)
    sample = {"prompt": "37+4?", "answer": answer, "messages": [{"role": "user", "content": "37+4?"}]}
    return asyncio.run(tool_chat(sample, policy, reward_fn="exact_match", **kw)), policy  # pyright: ignore[reportArgumentType]


def test_a_call_is_run_and_answered_and_the_final_reply_scored():
    assert load_workflow("tool_chat") is tool_chat
    (reward, metrics), policy = run([call("37+4"), "41"])
    assert reward == 1.0 and metrics["tool_ok"] == 1.0 and metrics["tool_calls"] == 1.0
    first, second = policy.requests
    assert [t["function"]["name"] for t in first["tools"]] == ["calculator"]
    assert second["messages"] == [
        {"role": "user", "content": "37+4?"},
        {"role": "assistant", "content": call("37+4")},  # the reply sent back exactly as answered
        {"role": "tool", "content": "41"},
    ]
    (reward, _), _ = run([call("37+4"), "42"])
    assert reward == 0.0


def test_failures_are_answered_or_end_the_episode_and_are_counted():
    (reward, metrics), policy = run([call("37+"), "41"])  # the calculator cannot parse it: told so, goes on
    assert reward == 1.0 and metrics["tool_exception"] == 1.0 and metrics["tool_ok"] == 0.0
    assert "raised ValueError" in policy.requests[1]["messages"][-1]["content"]
    (reward, metrics), policy = run([call("1", name="search")])  # no such tool: the episode ends
    assert reward == 0.0 and metrics["tool_unknown"] == 1.0 and len(policy.requests) == 1


def test_the_call_limit_ends_the_episode():
    (_, metrics), policy = run([call("1+1"), call("2+2"), call("3+3")], max_calls=2)
    assert metrics["tool_calls"] == 2.0 and len(policy.requests) == 3
