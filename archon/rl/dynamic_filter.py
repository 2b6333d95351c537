"""Dynamic sampling (DAPO): keep only prompt groups whose rewards differ, refilling the batch.

A group whose samples all got the same reward has no GRPO signal (every normalised reward
is 0), so a batch with many such groups trains on few.  ``collect_mixed_groups`` draws
rollout rounds (each one full batch of prompts, as verl's ``gen_batch_size`` equal to the
train batch) until it has a batch's worth of groups with differing rewards, or until
``max_rounds`` rounds were drawn; verl's ``algorithm.filter_groups`` does the same and
raises when its bound is hit, whereas here the batch is then completed with dropped groups
(in draw order) so that the step keeps its size, and the number taken back is reported.
Surplus mixed groups of the last round are discarded (as verl does).

The decision depends only on the rewards every rank received, so every rank draws the same
rounds; the data loader has consumed every prompt drawn, so a checkpoint's loader position
accounts for them and a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("archon.rl")

Round = tuple[list[Any], list[float], dict[str, float]]
"""What one rollout round gives: completions, their rewards, and timings (seconds)."""


def mixed_groups(rewards: Sequence[float], group_size: int) -> list[bool]:
    """For each group of ``group_size`` consecutive rewards: whether they are not all equal."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    return [len(set(rewards[i : i + group_size])) > 1 for i in range(0, len(rewards), group_size)]


def collect_mixed_groups(
    draw: Callable[[int], Round], *, group_size: int, max_rounds: int = 0, n_groups: int | None = None
) -> Round:
    """Rounds ``draw(0), draw(1), ...`` until ``n_groups`` groups with differing rewards are in hand
    (default: as many groups as the first round has) or ``max_rounds`` were drawn (0: no limit).

    Returns the kept completions and rewards (groups in draw order) and the summed timings
    plus ``dynamic_filter/*`` metrics: ``rounds``, ``refills`` (rounds after the first),
    ``dropped_groups`` (equal-reward groups left out), ``taken_back_groups`` (dropped groups
    used to complete the batch when the bound was hit), ``surplus_groups`` (mixed groups
    discarded beyond the batch) and ``reward_mean_generated`` (over every sample drawn).
    """
    kept: list[tuple[list[Any], list[float]]] = []
    dropped: list[tuple[list[Any], list[float]]] = []
    timing: dict[str, float] = {}
    all_rewards: list[float] = []
    rounds = 0
    while n_groups is None or len(kept) < n_groups:
        if max_rounds and rounds >= max_rounds:
            break
        completions, rewards, round_timing = draw(rounds)
        rounds += 1
        if n_groups is None:
            n_groups = len(rewards) // group_size
        for key, value in round_timing.items():
            timing[key] = timing.get(key, 0.0) + value
        all_rewards.extend(rewards)
        for g, mixed in enumerate(mixed_groups(rewards, group_size)):
            part = slice(g * group_size, (g + 1) * group_size)
            (kept if mixed else dropped).append((completions[part], rewards[part]))
    assert n_groups is not None
    taken_back = max(0, n_groups - len(kept))
    if taken_back:
        logger.warning(
            "dynamic filter: only %d of %d prompt groups had differing rewards after %d rounds "
            "(dynamic_filter.max_num_gen_batches); %d equal-reward groups complete the batch",
            len(kept),
            n_groups,
            rounds,
            taken_back,
        )
    groups = kept[:n_groups] + dropped[:taken_back]
    metrics = {
        "dynamic_filter/rounds": float(rounds),
        "dynamic_filter/refills": float(rounds - 1),
        "dynamic_filter/dropped_groups": float(len(dropped) - taken_back),
        "dynamic_filter/taken_back_groups": float(taken_back),
        "dynamic_filter/surplus_groups": float(max(0, len(kept) - n_groups)),
        "dynamic_filter/reward_mean_generated": sum(all_rewards) / max(1, len(all_rewards)),
    }
    completions = [c for group, _ in groups for c in group]
    rewards = [r for _, group in groups for r in group]
    return completions, rewards, {**timing, **metrics}
