"""Agent trajectories to the padded, token-aligned RL batch that ``build_rollout_batch`` makes for completions.

Row ``b`` is trajectory ``b``'s recorded ids (``Trajectory.tokens``): the same keys, dtypes and conventions as
single-turn completions (``input_ids, attention_mask, loss_mask, logprobs`` ``[B, S]``, ``rewards,
seq_no_eos_mask`` ``[B]``, ``FRESH_MASK`` with ``fresh_version``, ``routed_experts`` when the turns carry routing),
so GRPO groups (each prompt's episodes in consecutive rows) and PPO take multi-turn batches unchanged.
``loss_mask`` is 1 on every sampled id of every turn and 0 on context ids (prompt, tool results, user replies,
template text), so the episode reward placed on the last loss token is on the last sampled id, as for a completion.
Per-turn rewards add ``TURN_REWARDS``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from archon.rl.agent.trajectory import Trajectory
from archon.rl.rollout_batch import FRESH_MASK, TURN_REWARDS, routed_experts_rows


def build_agent_batch(
    trajectories: Sequence[Trajectory], pad_token_id: int = 0, fresh_version: int | None = None
) -> dict[str, torch.Tensor]:
    """The RL batch of ``trajectories`` (each prompt's episodes in a row, as GRPO groups them).

    ``fresh_version``: the policy version being trained, when sampled ids carry versions: adds ``FRESH_MASK``,
    1 on the sampled ids that version generated.  ``TURN_REWARDS`` is added when any trajectory has per-turn
    rewards.
    """
    if not trajectories:
        raise ValueError("build_agent_batch() got no trajectories; a step needs at least one")
    rows = []
    for i, traj in enumerate(trajectories):
        try:
            rows.append(traj.tokens())
            traj.episode_reward()  # checks the reward fields
        except ValueError as exc:
            raise ValueError(f"trajectory {i}: {exc}") from None
    lens = torch.tensor([len(r.input_ids) for r in rows])
    col = torch.arange(int(lens.max()))
    attention = col < lens[:, None]
    input_ids = torch.full(attention.shape, pad_token_id, dtype=torch.long)
    input_ids[attention] = torch.tensor([t for r in rows for t in r.input_ids], dtype=torch.long)
    loss_mask = torch.zeros(attention.shape, dtype=torch.float32)
    loss_mask[attention] = torch.tensor([m for r in rows for m in r.loss_mask], dtype=torch.float32)
    logprobs = torch.zeros(attention.shape, dtype=torch.float32)
    logprobs[attention] = torch.tensor([x for r in rows for x in r.logprobs], dtype=torch.float32)
    batch = {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "rewards": torch.tensor([t.episode_reward() for t in trajectories], dtype=torch.float32),
        "seq_no_eos_mask": torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        "attention_mask": attention.long(),
    }
    if fresh_version is not None:
        versions = torch.full(attention.shape, -1, dtype=torch.long)
        versions[attention] = torch.tensor([v for r in rows for v in r.versions], dtype=torch.long)
        batch[FRESH_MASK] = (versions == fresh_version).float()
    routings = [t.routed_experts() for t in trajectories]
    if any(r is not None for r in routings):  # MoE routing replay: each id as a server first routed it
        routed = [(r, len(row.input_ids), any(row.loss_mask)) for r, row in zip(routings, rows)]
        batch["routed_experts"] = routed_experts_rows(routed, attention.shape[1])
    if any(t.turn_rewards is not None for t in trajectories):
        batch[TURN_REWARDS] = _turn_reward_rows(trajectories, attention.shape[1])
    return batch


def _turn_reward_rows(trajectories: Sequence[Trajectory], width: int) -> torch.Tensor:
    """``[B, S]``: each turn's reward on its last sampled id (an episode reward on the row's last sampled id)."""
    out = torch.zeros(len(trajectories), width, dtype=torch.float32)
    for b, traj in enumerate(trajectories):
        ends = traj.turn_end_positions()
        per_turn = traj.turn_rewards if traj.turn_rewards is not None else [0.0] * (traj.n_turns - 1) + [traj.reward]
        sampled = [e for e in ends if e is not None]
        if not sampled:
            continue  # nothing sampled, nothing to credit (as token_rewards does for a row without loss tokens)
        for k, r in enumerate(per_turn):
            # A turn that sampled nothing (aborted) credits the latest sampled id before it, else the first one.
            end = ends[k]
            if end is None:
                end = max((e for e in ends[:k] if e is not None), default=sampled[0])
            out[b, end] += float(r or 0.0)
    return out


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Step metrics of a batch of episodes: mean and max turns, the fraction cut short, and the mean of each metric
    the workflows reported (over the episodes that reported it)."""
    if not trajectories:
        return {}
    turns = [t.n_turns for t in trajectories]
    out = {
        "agent/turns_mean": sum(turns) / len(turns),
        "agent/turns_max": float(max(turns)),
        "agent/truncated_frac": sum(t.truncation is not None for t in trajectories) / len(trajectories),
    }
    for name in sorted({k for t in trajectories for k in t.metrics}):
        values = [t.metrics[name] for t in trajectories if name in t.metrics]
        out[f"agent/{name}"] = sum(values) / len(values)
    return out
