"""Pipeline schedules by name, and the rules each one imposes on stages, microbatches and AC.

* ``1F1B`` and ``GPipe`` run one stage per rank.
* ``Interleaved1F1B`` and ``InterleavedZeroBubble`` run several stages per rank (loop placement).
* ``ZBVZeroBubble`` and ``DualPipeV`` run exactly two stages per rank (V placement).

Zero-bubble schedules (``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) split each
backward into an input-gradient step that keeps the graph alive (``retain_graph``) and a later
weight-gradient step.  Op-level selective AC caches recomputed ops for one backward only, and
the memory-budget mode needs torch.compile, which these schedules cannot run (torch refuses
compiled stages), so both are errors; full AC and layer-level selective AC work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from pipeline.placement import PlacementStyle
from pipeline.split import PipelineConfigError

SCHEDULES: dict[str, type] = {
    "1F1B": Schedule1F1B,
    "GPipe": ScheduleGPipe,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
SINGLE_STAGE = frozenset({"1F1B", "GPipe"})
ZERO_BUBBLE = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
V_SHAPED = frozenset({"ZBVZeroBubble", "DualPipeV"})
# Interleaved runtimes cut the microbatches into rounds of n // pp and need whole rounds.
_ROUNDS = frozenset({"Interleaved1F1B", "InterleavedZeroBubble"})


def check_schedule_name(name: str) -> None:
    if name not in SCHEDULES:
        raise PipelineConfigError(
            f"archon.pp_schedule = {name!r} is not a pipeline schedule; choose one of {', '.join(SCHEDULES)}"
        )


def placement_style(name: str) -> PlacementStyle:
    """``v`` for the V-shaped schedules, ``loop`` for the others."""
    check_schedule_name(name)
    return "v" if name in V_SHAPED else "loop"


def required_stages_per_rank(name: str) -> int | None:
    """Stages per rank the schedule needs (None: any number, default 2 when derived)."""
    check_schedule_name(name)
    if name in SINGLE_STAGE:
        return 1
    if name in V_SHAPED:
        return 2
    return None


def check_activation_checkpointing(
    name: str, gradient_checkpointing: bool, ac_mode: str, selective_ac_option: str
) -> None:
    """Zero-bubble schedules reject op-level selective AC and the memory-budget mode (see the module docstring)."""
    if name not in ZERO_BUBBLE or not gradient_checkpointing:
        return
    if ac_mode == "selective" and selective_ac_option == "op":
        raise PipelineConfigError(
            f"archon.pp_schedule = {name!r} splits backward into input and weight steps, "
            "which op-level selective AC (ac_mode = 'selective', selective_ac_option = 'op') "
            "cannot serve; use ac_mode = 'full', a layer-level selective_ac_option such as "
            "'2', or a non-zero-bubble schedule (1F1B, Interleaved1F1B)"
        )
    if ac_mode == "memory_budget":
        raise PipelineConfigError(
            f"archon.pp_schedule = {name!r} cannot run torch.compile, which ac_mode = "
            "'memory_budget' needs; use ac_mode = 'full' or a layer-level selective AC, or a "
            "non-zero-bubble schedule (1F1B, Interleaved1F1B)"
        )


def _valid_count(name: str, n: int, pp: int) -> bool:
    if name in _ROUNDS:
        return n % max(1, n // pp) == 0
    return True


def microbatch_count(name: str, requested: int, n_stages: int, pp: int) -> int:
    """Smallest microbatch count >= ``requested`` that the schedule runs well and accepts.

    At least ``n_stages``: with fewer, interleaved warm-up holds every microbatch's
    activations before the first backward (and 1F1B / DualPipeV refuse to run).
    """
    n = max(requested, n_stages, 1)
    while not _valid_count(name, n, pp):
        n += 1
    return n


def build_schedule(
    name: str,
    stages: list[PipelineStage],
    n_microbatches: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None,
) -> Any:
    """The torch schedule ``name`` over this rank's ``stages``.

    Gradients are not rescaled by the schedule (``scale_grads=False``): the loss of every
    microbatch already carries its weight in the global batch.
    """
    check_schedule_name(name)
    cls = SCHEDULES[name]
    if name in SINGLE_STAGE:
        if len(stages) != 1:
            raise PipelineConfigError(
                f"archon.pp_schedule = {name!r} runs one stage per rank, but this rank holds "
                f"{len(stages)}; use Interleaved1F1B for several stages per rank"
            )
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
