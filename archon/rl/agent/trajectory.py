"""One agent episode as the exact token ids the rollout servers saw and sampled, turn by turn.

A ``Turn`` carries only the ids it appends: the context segments added before the turn's request (the first
turn's prompt; later turns' tool results, user replies, template text) and then the ids the policy sampled.  The
prompt of turn ``k`` is therefore, by construction, every id of the turns before it plus turn ``k``'s context:
nothing is re-tokenised between turns, and the ids trained are the ids generated.  ``Trajectory.add_turn`` checks
that the prompt actually sent to a server starts with that recorded prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from archon.rl.rollout_batch import Completion

SAMPLED_ROLE = "assistant"
"""Role of the ids the policy sampled in ``TrajectoryTokens.roles``."""


@dataclass(frozen=True)
class Segment:
    """Context ids a turn appends, with where they came from."""

    ids: list[int]
    """Token ids appended to the conversation (never sampled by the policy, never trained on)."""
    role: str
    """Their source: a chat role ('system', 'user', 'tool'), or 'template' for chat-template text between messages."""


@dataclass
class Turn:
    """One request to the policy: the context ids it appends, then the ids sampled from the policy."""

    context: list[Segment]
    """Ids appended before the request, in order (the first turn's are the whole prompt)."""
    output_ids: list[int]
    """Sampled ids (including a final EOS/stop token when the turn stopped on one)."""
    output_logprobs: list[float]
    """Behaviour logprob of each sampled id, as the server reports it."""
    finish_reason: str
    """'stop' (EOS or a stop token), 'length' (token budget or context) or 'abort'."""
    output_versions: list[int] | None = None
    """Policy version that sampled each id (asynchronous RL); None when not tracked."""
    routed_experts: Any = None
    """MoE routing replay: int array ``[prompt + output - 1, n_layers, top_k]`` of the experts the server ran this
    request's tokens through (``Completion.routed_experts``), or None."""

    def __post_init__(self) -> None:
        if len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"a turn has {len(self.output_ids)} sampled ids but {len(self.output_logprobs)} logprobs; "
                "request generations with return_logprob = true"
            )
        if self.output_versions is not None and len(self.output_versions) != len(self.output_ids):
            raise ValueError(
                f"a turn has {len(self.output_ids)} sampled ids but {len(self.output_versions)} versions; "
                "give one policy version per sampled id, or none"
            )

    @property
    def context_ids(self) -> list[int]:
        """The ids this turn appends before its request."""
        return [t for s in self.context for t in s.ids]

    @classmethod
    def from_completion(cls, context: Sequence[Segment], completion: Completion) -> Turn:
        """The turn of a server's ``completion`` whose request appended ``context`` (only the new ids)."""
        return cls(
            list(context),
            list(completion.output_ids),
            list(completion.output_logprobs),
            completion.finish_reason,
            None if completion.output_versions is None else list(completion.output_versions),
            completion.routed_experts,
        )


@dataclass
class TrajectoryTokens:
    """A trajectory flattened: per-token lists, all of one length."""

    input_ids: list[int]
    """Every recorded id in order: each turn's context, then its sampled ids."""
    loss_mask: list[int]
    """1 exactly on sampled ids."""
    logprobs: list[float]
    """Behaviour logprob of each sampled id; 0.0 on context ids."""
    versions: list[int]
    """Policy version of each sampled id; -1 on context ids and where versions were not tracked."""
    roles: list[str]
    """Where each id came from: its context segment's role, or ``SAMPLED_ROLE``."""


@dataclass
class Trajectory:
    """The ordered turns of one episode and its reward: one for the episode, or one per turn."""

    turns: list[Turn] = field(default_factory=list)
    """The episode's requests, in order."""
    reward: float | None = None
    """The episode's reward (lands where a single-turn completion's does: on the last sampled id)."""
    turn_rewards: list[float] | None = None
    """One reward per turn instead (each lands on its turn's last sampled id); set this or ``reward``."""
    truncation: str | None = None
    """Why the episode was cut short by the agent (e.g. 'max_turns', 'context'); None when it ended itself."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the workflow measured of the episode (e.g. tool-call success); step metrics ``agent/<name>`` average
    them over the episodes that report them."""

    @property
    def n_turns(self) -> int:
        """Number of requests made to the policy."""
        return len(self.turns)

    @property
    def truncated(self) -> bool:
        """True when the episode did not end with a turn that stopped on EOS/stop token (as ``Completion``)."""
        return self.truncation is not None or not self.turns or self.turns[-1].finish_reason != "stop"

    def ids(self) -> list[int]:
        """Every recorded id so far: the prefix the next request's prompt must start with."""
        return [t for turn in self.turns for t in (*turn.context_ids, *turn.output_ids)]

    def add_turn(self, context: Sequence[Segment], completion: Completion) -> Turn:
        """Record ``completion`` as the next turn, after checking its prompt is the recorded ids plus ``context``."""
        recorded = self.ids()
        expected = recorded + [t for s in context for t in s.ids]
        if list(completion.prompt_ids) != expected:
            at = next((i for i, (a, b) in enumerate(zip(completion.prompt_ids, expected)) if a != b), None)
            where = f"first differs at token {at}" if at is not None else "lengths differ"
            raise ValueError(
                f"turn {self.n_turns}'s prompt ({len(completion.prompt_ids)} ids) is not the recorded "
                f"{len(recorded)} ids plus the turn's context ({where}); build each "
                "request from Trajectory.ids() plus the new ids, never by re-tokenising the conversation"
            )
        turn = Turn.from_completion(context, completion)
        self.turns.append(turn)
        return turn

    def episode_reward(self) -> float:
        """The episode's reward: ``reward``, or the sum of ``turn_rewards``."""
        self._check_rewards()
        if self.turn_rewards is not None:
            return float(sum(self.turn_rewards))
        assert self.reward is not None  # _check_rewards: exactly one is set
        return float(self.reward)

    def _check_rewards(self) -> None:
        if (self.reward is None) == (self.turn_rewards is None):
            raise ValueError(
                "a trajectory needs exactly one of reward (the episode's) and turn_rewards (one per turn); "
                f"got reward={self.reward!r}, turn_rewards={self.turn_rewards!r}"
            )
        if self.turn_rewards is not None and len(self.turn_rewards) != self.n_turns:
            raise ValueError(f"{len(self.turn_rewards)} turn_rewards for {self.n_turns} turns; give one per turn")

    def tokens(self) -> TrajectoryTokens:
        """The episode flattened; raises if it has no turns or its first turn has no prompt."""
        if not self.turns:
            raise ValueError("a trajectory has no turns; record at least one request before training on it")
        if not self.turns[0].context_ids:
            raise ValueError("a trajectory's first turn has an empty prompt; every RL prompt needs at least one token")
        out = TrajectoryTokens([], [], [], [], [])
        for turn in self.turns:
            for seg in turn.context:
                n = len(seg.ids)
                out.input_ids += seg.ids
                out.loss_mask += [0] * n
                out.logprobs += [0.0] * n
                out.versions += [-1] * n
                out.roles += [seg.role] * n
            n = len(turn.output_ids)
            out.input_ids += turn.output_ids
            out.loss_mask += [1] * n
            out.logprobs += [float(x) for x in turn.output_logprobs]
            out.versions += list(turn.output_versions) if turn.output_versions is not None else [-1] * n
            out.roles += [SAMPLED_ROLE] * n
        return out

    def turn_end_positions(self) -> list[int | None]:
        """Index in ``tokens()`` of each turn's last sampled id (None for a turn that sampled nothing)."""
        out: list[int | None] = []
        pos = 0
        for turn in self.turns:
            pos += len(turn.context_ids) + len(turn.output_ids)
            out.append(pos - 1 if turn.output_ids else None)
        return out

    def sampled_versions(self) -> list[int] | None:
        """The policy version of every sampled id, turn after turn; None when some turn's are not tracked."""
        if any(turn.output_versions is None for turn in self.turns):
            return None
        return [v for turn in self.turns for v in turn.output_versions or ()]

    def routed_experts(self) -> Any:
        """``[len(tokens()) - 1, n_layers, top_k]``: the experts each id was routed through when a server first ran it
        (a turn's request runs the ids before it again; the last id is never run), or None without routing.

        Each id's routing comes from the first turn whose request ran it: turn ``k`` runs every id before its last
        sampled one, so its new ids (context and sampled) come from its own request, and its last sampled id from
        turn ``k + 1``'s prefill, as the single-turn completion's routing covers prompt and output but the last id.
        """
        if all(turn.routed_experts is None for turn in self.turns):
            return None
        parts = []
        filled = 0
        end = 0
        for k, turn in enumerate(self.turns):
            end += len(turn.context_ids) + len(turn.output_ids)
            if turn.routed_experts is None:
                raise ValueError(f"turn {k} has no routed experts while others do; request them for every turn")
            routed = np.asarray(turn.routed_experts)
            if routed.shape[0] < end - 1:
                raise ValueError(
                    f"turn {k}'s routed experts cover {routed.shape[0]} ids, expected {end - 1} (its prompt and "
                    "output but the last id)"
                )
            parts.append(routed[filled : end - 1])
            filled = end - 1
        return np.concatenate(parts, axis=0)
