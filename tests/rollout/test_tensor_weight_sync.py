"""The colocated weight sync (``rollout.weight_sync = 'tensor'``): buckets by reference, the version on the last."""

from __future__ import annotations

import pytest
import torch

from archon.rollout.tensor_weight_sync import TensorWeightSync
from archon.rollout.weight_sync import WeightSyncError


class _Engine:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def named_full_tensors(self, dtype=None):
        for name, t in self.tensors.items():
            yield name, t if dtype is None else t.to(dtype)


class _Client:
    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple[list[str], str | None]] = []
        self.fail_at = fail_at

    def update_weights_from_tensor(self, bucket, version):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("server refused")
        self.calls.append(([name for name, _ in bucket], version))


def test_buckets_hold_at_most_chunk_mb_and_only_the_last_names_the_version():
    mib = 1 << 20
    # 0.4 MiB each: two fit in a 1 MiB bucket, a third does not.
    tensors = {f"w{i}": torch.full((mib // 10,), float(i)) for i in range(5)}
    client = _Client()
    stats = TensorWeightSync(_Engine(tensors), client, chunk_mb=1).sync(7)
    assert client.calls == [(["w0", "w1"], None), (["w2", "w3"], None), (["w4"], "7")]
    assert stats["weight_sync_bytes"] == sum(t.numel() * 4 for t in tensors.values())


def test_a_server_refusing_a_bucket_fails_the_sync_naming_it():
    tensors = {f"w{i}": torch.zeros(300_000) for i in range(3)}
    with pytest.raises(WeightSyncError, match="failed at w1 .. w1: server refused"):
        TensorWeightSync(_Engine(tensors), _Client(fail_at=1), chunk_mb=1).sync(3)
