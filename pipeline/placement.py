"""Which pipeline rank runs which stage: loop or V placement.

Loop (1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble): stage ``s`` runs on rank
``s % pp``, so a rank's stages are ``pp`` apart::

    pp=2, 4 stages   rank 0: 0, 2     rank 1: 1, 3

V (ZBVZeroBubble, DualPipeV): stages zig-zag down the ranks and back up, so rank ``r``
holds stages ``r`` and ``2*pp - 1 - r``; the first and the last stage share rank 0 and the
loss's backward starts without waiting for another rank::

    pp=2, 4 stages   rank 0: 0, 3     rank 1: 1, 2

These tables are the ones torch.distributed.pipelining's schedules assume for the same style.
"""

from __future__ import annotations

from typing import Literal

PlacementStyle = Literal["loop", "v"]


def rank_of_stage(stage: int, pp: int, n_stages: int, style: PlacementStyle) -> int:
    """Pipeline rank (0..pp-1) that runs ``stage``."""
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is outside 0..{n_stages - 1}")
    if n_stages % pp:
        raise ValueError(f"{n_stages} stages cannot be shared equally by {pp} pipeline ranks")
    if style == "loop":
        return stage % pp
    if style == "v":
        sweep, offset = divmod(stage, pp)
        # Even sweeps go down the ranks, odd sweeps come back up.
        return offset if sweep % 2 == 0 else pp - 1 - offset
    raise ValueError(f"unknown placement style {style!r}; use 'loop' or 'v'")


def stages_of_rank(rank: int, pp: int, n_stages: int, style: PlacementStyle) -> list[int]:
    """Stages run by pipeline rank ``rank``, in increasing order."""
    return [s for s in range(n_stages) if rank_of_stage(s, pp, n_stages, style) == rank]
