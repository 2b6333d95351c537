"""Multi-turn and agentic RL on the trainer's side.

Episodes recorded as the exact token ids the servers saw and sampled (``trajectory``), chat messages
appended to them without re-tokenising (``chat_tokens``), episodes to the token-aligned RL batch
(``agent_batch``), tool calls parsed and tools run safely (``tools``), an OpenAI endpoint recording
each episode's ids (``proxy``), and the user's async agent functions run as recorded episodes (``workflow``).
"""

from archon.rl.agent.agent_batch import agent_metrics, build_agent_batch
from archon.rl.agent.chat_tokens import append_messages, render_chat, start_messages
from archon.rl.agent.proxy import MAX_TOKENS, MAX_TURNS, RecordingProxy
from archon.rl.agent.tools import (
    BUILTIN_TOOLS,
    TOOL_OUTCOMES,
    ParsedReply,
    Tool,
    ToolMetrics,
    ToolResult,
    calculator,
    load_tool,
    load_tools,
    parse_tool_calls,
    run_tool_call,
    tools_schema,
)
from archon.rl.agent.trajectory import Segment, Trajectory, TrajectoryTokens, Turn
from archon.rl.agent.workflow import ERROR, TIMEOUT, Workflow, load_workflow, run_episode
from archon.rl.rollout_batch import TURN_REWARDS

__all__ = [
    "BUILTIN_TOOLS",
    "TOOL_OUTCOMES",
    "ParsedReply",
    "Tool",
    "ToolMetrics",
    "ToolResult",
    "calculator",
    "load_tool",
    "load_tools",
    "parse_tool_calls",
    "run_tool_call",
    "tools_schema",
    "ERROR",
    "MAX_TOKENS",
    "MAX_TURNS",
    "TIMEOUT",
    "TURN_REWARDS",
    "RecordingProxy",
    "Segment",
    "Trajectory",
    "TrajectoryTokens",
    "Turn",
    "Workflow",
    "agent_metrics",
    "append_messages",
    "build_agent_batch",
    "load_workflow",
    "render_chat",
    "run_episode",
    "start_messages",
]
