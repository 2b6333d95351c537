"""The colocated weight sync (``rollout.weight_sync = 'tensor'``): buckets by reference, the version on the last,
every server the tensors of its own trainer ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import run_distributed

from archon.rollout.tensor_weight_sync import TensorWeightSync
from archon.rollout.weight_sync import WeightSyncError
from archon.wire.tensor_ipc import deserialize_named_tensors


class _Engine:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def named_full_tensors(self, dtype=None):
        for name, t in self.tensors.items():
            yield name, t if dtype is None else t.to(dtype)


class _Client:
    """Records what each server would load: per call, per server, per tensor-parallel rank, (name, first value)."""

    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple[list[list[list[tuple[str, float]]]], str | None, bool]] = []
        self.fail_at = fail_at

    def update_weights_from_parts(self, parts, version, *, first):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("server refused")
        opened = [
            [[(name, float(t.flatten()[0])) for name, t in deserialize_named_tensors(part)] for part in server]
            for server in parts
        ]
        self.calls.append((opened, version, first))


def test_buckets_hold_at_most_chunk_mb_and_only_the_last_names_the_version():
    mib = 1 << 20
    # 0.4 MiB each: two fit in a 1 MiB bucket, a third does not.
    tensors = {f"w{i}": torch.full((mib // 10,), float(i)) for i in range(5)}
    client = _Client()
    stats = TensorWeightSync(_Engine(tensors), client, chunk_mb=1).sync(7)
    assert client.calls == [
        ([[[("w0", 0.0), ("w1", 1.0)]]], None, True),
        ([[[("w2", 2.0), ("w3", 3.0)]]], None, False),
        ([[[("w4", 4.0)]]], "7", False),
    ]
    assert stats["weight_sync_bytes"] == sum(t.numel() * 4 for t in tensors.values())


def test_a_server_refusing_a_bucket_fails_the_sync_naming_it():
    tensors = {f"w{i}": torch.zeros(300_000) for i in range(3)}
    with pytest.raises(WeightSyncError, match="failed at w1 .. w1: server refused"):
        TensorWeightSync(_Engine(tensors), _Client(fail_at=1), chunk_mb=1).sync(3)


def _sync_from_every_rank(ranks_per_server: int, fail_at: int | None) -> Any:
    """Each rank's engine holds tensors filled with its rank (to see whose memory a server would map)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    tensors = {f"w{i}": torch.full((100_000,), float(rank)) for i in range(3)}
    client = _Client(fail_at) if rank == 0 else None
    TensorWeightSync(_Engine(tensors), client, chunk_mb=1, ranks_per_server=ranks_per_server).sync(5)
    return client.calls if client is not None else None


@pytest.mark.parametrize("ranks_per_server", [1, 2])
def test_each_server_gets_the_tensors_of_its_own_trainer_ranks(ranks_per_server):
    calls = run_distributed(_sync_from_every_rank, 2, ranks_per_server, None)[0]
    names = ["w0", "w1", "w2"]
    # 0.4 MiB each, 1 MiB buckets: w0+w1, then w2 with the version.
    assert [(version, first) for _, version, first in calls] == [(None, True), ("5", False)]
    per_call = [names[:2], names[2:]]
    for (servers, _, _), bucket in zip(calls, per_call):
        if ranks_per_server == 1:  # server i runs on rank i's GPU
            assert servers == [[[(n, 0.0) for n in bucket]], [[(n, 1.0) for n in bucket]]]
        else:  # one server over both ranks' GPUs: one entry per tensor-parallel rank, in rank order
            assert servers == [[[(n, 0.0) for n in bucket], [(n, 1.0) for n in bucket]]]


def _refused() -> str:
    try:
        _sync_from_every_rank(1, fail_at=1)
    except WeightSyncError as exc:
        return str(exc)
    return "no error"


def test_a_refused_bucket_fails_the_sync_on_every_rank():
    rank0, rank1 = run_distributed(_refused, 2)
    assert rank0 == "tensor weight sync of version 5 failed at w2 .. w2: server refused"
    assert rank1 == f"weight sync failed on trainer rank 0: {rank0}"
