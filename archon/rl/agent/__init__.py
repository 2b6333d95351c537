"""Multi-turn and agentic RL on the trainer's side: episodes recorded as the exact token ids the servers saw and
sampled (``trajectory``), chat messages appended to them without re-tokenising (``chat_tokens``), and episodes to
the token-aligned RL batch (``agent_batch``)."""

from archon.rl.agent.agent_batch import TURN_REWARDS, agent_metrics, build_agent_batch
from archon.rl.agent.chat_tokens import append_messages, render_chat, start_messages
from archon.rl.agent.trajectory import Segment, Trajectory, TrajectoryTokens, Turn

__all__ = [
    "TURN_REWARDS",
    "Segment",
    "Trajectory",
    "TrajectoryTokens",
    "Turn",
    "agent_metrics",
    "append_messages",
    "build_agent_batch",
    "render_chat",
    "start_messages",
]
