"""Point-to-point transfers of a forward-only pipeline pass: one global order, and the transport that carries them.

NCCL runs the sends and receives between two ranks on one stream per peer pair, in the order
they were issued, and a large send does not finish until the peer's matching receive runs.  So
if one end of a pair issues "send, send, recv" while the other issues "recv, send, recv", the
second send waits for a receive queued behind a send that waits for it: a deadlock that gloo
(which buffers sends) never shows.  Every rank therefore walks one global order of transfers
and does its part of each: transfer ``(stage, microbatch)`` carries the output of ``stage`` for
that microbatch to ``stage + 1``, stage-major.  Both ends of every pair then see their common
transfers in the same order, and as the order is one for all pairs, no cycle of waits forms.
Stage-major is also a dependency order: a stage's output for a microbatch is computed from a
transfer that comes earlier (the previous stage's) or from a local stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from pipeline.placement import PlacementStyle, rank_of_stage


@dataclass(frozen=True)
class P2POp:
    """One rank's part in one transfer of the forward-only pass."""

    kind: Literal["send", "recv"]
    """``send`` on the rank of ``stage``, ``recv`` on the rank of ``stage + 1``."""
    stage: int
    """The stage whose output travels (to ``stage + 1``)."""
    microbatch: int
    """Index of the microbatch in the step."""
    peer: int
    """Pipeline rank (0..pp-1) at the other end."""


def forward_p2p_ops(rank: int, pp: int, n_stages: int, n_microbatches: int, style: PlacementStyle) -> list[P2POp]:
    """Pipeline rank ``rank``'s sends and receives of a forward-only pass, in the global stage-major order."""
    ops = []
    for stage in range(n_stages - 1):
        src = rank_of_stage(stage, pp, n_stages, style)
        dst = rank_of_stage(stage + 1, pp, n_stages, style)
        if src == dst or rank not in (src, dst):
            continue  # the hand-over stays on one rank, or this rank is not an end of it
        for mb in range(n_microbatches):
            if rank == src:
                ops.append(P2POp("send", stage, mb, dst))
            else:
                ops.append(P2POp("recv", stage, mb, src))
    return ops


class Waitable(Protocol):
    """A pending send (``torch.distributed.Work`` is one)."""

    def wait(self) -> object: ...


class P2PTransport(Protocol):
    """Sends and receives between the ranks of one pipeline group, addressed by pipeline rank."""

    def isend(self, tensor: torch.Tensor, peer: int) -> Waitable:
        """Start sending ``tensor`` to ``peer``; the caller keeps it alive until ``wait()`` returns."""
        ...

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Receive from ``peer`` into ``tensor`` (on NCCL, ordered on the stream rather than the host)."""
        ...


class GroupTransport:
    """``torch.distributed`` isend / recv over a pipeline process group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def isend(self, tensor: torch.Tensor, peer: int) -> Waitable:
        work = dist.isend(tensor, dst=dist.get_global_rank(self.group, peer), group=self.group)
        assert work is not None, "isend returns None only on ranks outside the group"
        return work

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        dist.recv(tensor, src=dist.get_global_rank(self.group, peer), group=self.group)
