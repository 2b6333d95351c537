"""The forward-only pipeline pass under NCCL's point-to-point rules, on CPU.

NCCL runs the sends and receives between two ranks on one FIFO stream per pair (both
directions), and a large send waits for the peer's matching receive; gloo buffers sends, so a
mismatched order that deadlocks on GPUs passes on CPU.  Two checks stand in for NCCL here:

* a simulator of those rules (one FIFO per pair, a send completes only together with its
  receive at the head of the peer's FIFO, a send's data waits for the receives upstream of it)
  runs the planned order of every rank to the end, for loop and V placement and several pp;
  the old order (each rank's stages one after the other) deadlocks in it;
* two gloo ranks run the real runner through a recording transport: both ends of the pair
  issue their operations in the same order, and the last stage's outputs equal the
  single-device model's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from hf_fixtures import decoder, save_tiny_hf

from pipeline.p2p import GroupTransport, P2POp, Waitable, forward_p2p_ops
from pipeline.placement import PlacementStyle, rank_of_stage, stages_of_rank
from pipeline.runner import PipelineRunner, StageBoundary
from pipeline.split import build_stage_module, stage_module_names


def simulate_nccl(ops_by_rank: list[list[P2POp]]) -> list[tuple[int, P2POp]]:
    """Run every rank's issued operations under NCCL's rules; return the ops left when nothing can move.

    Each rank's operations with one peer form a FIFO; the heads of the two FIFOs of a pair
    complete together when they are the send and the receive of one transfer, and the send's
    data is there (every receive of the same microbatch from an earlier stage, on the sending
    rank, has completed).  Hosts never block: NCCL orders work on streams.
    """
    fifos: dict[tuple[int, int], list[P2POp]] = defaultdict(list)
    for rank, ops in enumerate(ops_by_rank):
        for op in ops:
            fifos[(rank, op.peer)].append(op)
    received: set[tuple[int, int, int]] = set()  # (rank, stage, microbatch) of completed receives

    def data_ready(rank: int, send: P2POp) -> bool:
        upstream = [op for op in ops_by_rank[rank] if op.kind == "recv" and op.microbatch == send.microbatch]
        return all((rank, op.stage, op.microbatch) in received for op in upstream if op.stage < send.stage)

    moved = True
    while moved:
        moved = False
        for (a, b), fifo in fifos.items():
            other = fifos[(b, a)]
            if not fifo or not other or fifo[0].kind != "send":
                continue
            send, recv = fifo[0], other[0]
            if recv.kind == "recv" and (recv.stage, recv.microbatch) == (send.stage, send.microbatch):
                if data_ready(a, send):
                    fifo.pop(0)
                    other.pop(0)
                    received.add((b, recv.stage, recv.microbatch))
                    moved = True
    return [(rank, op) for (rank, _), fifo in fifos.items() for op in fifo]


def old_forward_ops(rank: int, pp: int, n_stages: int, n_mb: int, style: PlacementStyle) -> list[P2POp]:
    """The order the runner used before: each of the rank's stages over all microbatches, in turn."""
    ops = []
    for sid in stages_of_rank(rank, pp, n_stages, style):
        for i in range(n_mb):
            if sid > 0 and (src := rank_of_stage(sid - 1, pp, n_stages, style)) != rank:
                ops.append(P2POp("recv", sid - 1, i, src))
            if sid < n_stages - 1 and (dst := rank_of_stage(sid + 1, pp, n_stages, style)) != rank:
                ops.append(P2POp("send", sid, i, dst))
    return ops


LAYOUTS = [
    # (pp, stages, placement)
    (2, 2, "loop"),
    (2, 4, "loop"),  # Interleaved1F1B: rank 0 holds stages 0 and 2
    (2, 6, "loop"),
    (3, 6, "loop"),
    (4, 8, "loop"),
    (2, 4, "v"),  # ZBVZeroBubble / DualPipeV: rank 0 holds stages 0 and 3
    (3, 6, "v"),
    (4, 8, "v"),
]


@pytest.mark.parametrize(("pp", "n_stages", "style"), LAYOUTS)
def test_planned_order_completes_under_nccl_rules(pp, n_stages, style):
    for n_mb in (1, 3, 5):
        plans = [forward_p2p_ops(r, pp, n_stages, n_mb, style) for r in range(pp)]
        assert simulate_nccl(plans) == []
        # Every hand-over between ranks is sent once and received once.
        crossings = sum(
            rank_of_stage(s, pp, n_stages, style) != rank_of_stage(s + 1, pp, n_stages, style)
            for s in range(n_stages - 1)
        )
        assert sum(len(p) for p in plans) == 2 * crossings * n_mb


def test_old_order_deadlocks_under_nccl_rules():
    # Loop placement with two stages per rank: rank 1 alternates recv/send with rank 0, while
    # rank 0 sends every microbatch first.  The simulator must catch it.
    old = [old_forward_ops(r, 2, 4, 3, "loop") for r in range(2)]
    stuck = simulate_nccl(old)
    assert stuck and {op.kind for _, op in stuck} == {"send", "recv"}
    # With one stage per rank the old order was already consistent.
    assert simulate_nccl([old_forward_ops(r, 2, 2, 3, "loop") for r in range(2)]) == []


# ---- the real runner on two gloo ranks ----------------------------------------------------------


@dataclass
class _Recorded:
    kind: str
    peer: int
    checksum: float


class RecordingTransport:
    """The gloo transport, noting each operation in issue order with the data's checksum."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.inner = GroupTransport(group)
        self.log: list[_Recorded] = []

    def isend(self, tensor: torch.Tensor, peer: int) -> Waitable:
        self.log.append(_Recorded("send", peer, float(tensor.double().sum())))
        return self.inner.isend(tensor, peer)

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        self.inner.recv(tensor, peer)
        self.log.append(_Recorded("recv", peer, float(tensor.double().sum())))


def _microbatches(n_mb: int, seq: int, vocab: int) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n_mb):
        tokens = torch.randint(1, vocab, (1, seq), generator=g)
        cu = torch.tensor([0, 5, seq], dtype=torch.int32)  # two packed sequences
        positions = torch.cat([torch.arange(5), torch.arange(seq - 5)]).unsqueeze(0)
        out.append((tokens, {"positions": positions, "cu_seqlens": cu}))
    return out


def _pipelined_forward(path: str, style: PlacementStyle, n_stages: int, n_mb: int):
    import models

    torch.manual_seed(0)
    model = decoder(models.load_hf_model(path))
    model.eval()
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    mbs = _microbatches(n_mb, 12, 128)
    rank, pp = dist.get_rank(), dist.get_world_size()
    names = stage_module_names(len(model.layers), n_stages)
    stage_ids = stages_of_rank(rank, pp, n_stages, style)
    parts = [build_stage_module(model, names[s]) for s in stage_ids]
    transport = RecordingTransport(group)
    runner = PipelineRunner(
        parts,
        stage_ids,
        n_stages,
        "Interleaved1F1B" if style == "loop" else "ZBVZeroBubble",
        style,
        group,
        torch.device("cpu"),
        StageBoundary(hidden_dim=model.args.dim, dtype=torch.float32),
        transport=transport,
    )
    got: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        runner.forward_step(mbs, lambda out, i: got.__setitem__(i, out.clone()))
        ref = {i: model(tokens, **kwargs) for i, (tokens, kwargs) in enumerate(mbs)}
    last_here = n_stages - 1 in stage_ids
    if last_here:
        assert sorted(got) == list(range(n_mb))
        for i in range(n_mb):
            torch.testing.assert_close(got[i], ref[i], atol=1e-5, rtol=1e-5)
    else:
        assert not got
    return [(r.kind, r.peer, r.checksum) for r in transport.log], last_here


@pytest.mark.parametrize("style", ["loop", "v"])
def test_runner_orders_both_ends_alike_and_matches_single_device(tmp_path, style):
    save_tiny_hf(tmp_path, "qwen3", seed=3, num_hidden_layers=4)
    n_mb = 5
    results = run_distributed(_pipelined_forward, 2, str(tmp_path), style, 4, n_mb, timeout=180)
    (log0, last0), (log1, last1) = results
    assert last0 == (style == "v") and last1 == (style == "loop")
    # Rank 0's k-th operation with rank 1 is the other end of rank 1's k-th operation with rank 0.
    crossings = 3 if style == "loop" else 2  # loop: 0->1, 1->2, 2->3 cross ranks; V: 0->1 and 2->3
    assert len(log0) == len(log1) == crossings * n_mb
    assert [k for k, _, _ in log0] == ["recv" if k == "send" else "send" for k, _, _ in log1]
    for (_, peer0, sum0), (_, peer1, sum1) in zip(log0, log1):
        assert (peer0, peer1) == (1, 0)
        assert sum0 == pytest.approx(sum1, rel=1e-6)
