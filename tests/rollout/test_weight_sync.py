"""Weight sync from 2 trainer ranks (forked, gloo) to 2 fake SGLang servers (subprocesses, really joining the group)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed, wait_until
from fake_sglang import configure, fake_command, fetch_state, fetch_weights
from safetensors.torch import save_file

import archon.rollout.weight_sync as weight_sync_module
from archon.config import load_config
from archon.launch.servers import LaunchSpec, RolloutLauncher, free_ports
from archon.rollout.client import RolloutClient
from archon.rollout.weight_sync import (
    DiskWeightSync,
    DistributedWeightSync,
    WeightSyncError,
    build_weight_sync,
    dtype_name,
    weight_group_backend,
    weight_sync_for,
)
from archon.wire.weight_group import bucket_nbytes, flatten_bucket, unflatten_bucket

if TYPE_CHECKING:
    # The test doubles duck-type it (their methods take no ``**kw``): cast at each use.
    from archon.rollout.weight_sync import WeightSyncEngine

# HF-style names and full shapes; at 1 MiB buckets in float32 they pack as [[q, k], [v], [embed], [norm, bias]].
SHAPES = {
    "model.layers.0.self_attn.q_proj.weight": (64, 1024),  # 256 KiB
    "model.layers.0.self_attn.k_proj.weight": (128, 1024),  # 512 KiB
    "model.layers.0.self_attn.v_proj.weight": (96, 1024),  # 384 KiB
    "model.embed_tokens.weight": (640, 1024),  # 2.5 MiB: larger than a bucket
    "model.norm.weight": (32, 1024),  # 128 KiB
    "lm_head.bias": (16,),  # 64 B
}
NAMES = list(SHAPES)


def full_tensor(name: str, step: int) -> torch.Tensor:
    """The full parameter at a training step, computed independently on every process."""
    gen = torch.Generator().manual_seed(NAMES.index(name) + 1)
    return torch.randn(SHAPES[name], generator=gen) * (step + 1) + step


class ShardedEngine:
    """Holds a dim-0 shard per rank; named_full_tensors all-gathers each one (a real collective)."""

    def __init__(self, step: int = 0):
        self.step = step

    def _shard(self, name: str) -> torch.Tensor:
        full = full_tensor(name, self.step)
        return full.chunk(dist.get_world_size())[dist.get_rank()].clone()

    def named_full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in NAMES:
            shard = self._shard(name)
            parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, shard)
            full = torch.cat(parts)
            yield name, full.to(dtype) if dtype is not None else full

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        tensors = dict(self.named_full_tensors(dtype))
        if dist.get_rank() == 0:
            save_file(tensors, os.path.join(path, "model.safetensors"))
            Path(path, "config.json").write_text('{"model_type": "fake"}')
        dist.barrier()


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[list[str]]:
    logs = tmp_path_factory.mktemp("rollout_logs")
    specs = [
        # /health at once: SGLang's one-second /health (the fake's default) would only slow the start.
        LaunchSpec(i, fake_command(p, "--health-delay-s", "0"), {}, "127.0.0.1", p, logs / f"server_{i}.log")
        for i, p in enumerate(free_ports(2))
    ]
    with RolloutLauncher(specs, setup_timeout=300) as launcher:
        yield launcher.addrs


@pytest.fixture(autouse=True)
def reset_knobs(servers):
    for addr in servers:
        configure(addr, fail_weight_update="", fail_after_buckets=-1)


def _snapshot(addrs: list[str]) -> list[dict[str, Any]]:
    return [{"state": fetch_state(a), "weights": fetch_weights(a)} for a in addrs]


def _distributed_worker(addrs: list[str]) -> dict[str, Any]:
    client = RolloutClient(addrs, setup_timeout=300, backoff_s=0.01)
    engine = ShardedEngine(step=0)
    sync = build_weight_sync(
        "distributed", cast("WeightSyncEngine", engine), client, chunk_mb=1, backend="gloo", master_address="127.0.0.1"
    )
    assert isinstance(sync, DistributedWeightSync)
    sync.group_name = "wsync_happy"
    sync.setup()
    out: dict[str, Any] = {"v1": sync.sync(1)}
    if dist.get_rank() == 0:
        out["after_v1"] = _snapshot(addrs)
    engine.step = 1
    sync.dtype = torch.bfloat16  # what a bf16 server would be sent
    sync.flattened = True  # each bucket as one broadcast of its bytes (SGLang's 'flattened_bucket')
    out["v2"] = sync.sync("2", servers_quiet=True)  # the caller holds every request back: no pause
    if dist.get_rank() == 0:
        out["after_v2"] = _snapshot(addrs)
    sync.close()
    client.close()
    return out


def test_distributed_sync_sends_exact_full_tensors_in_buckets(servers):
    results = run_distributed(_distributed_worker, 2, servers, timeout=300)
    q, k, v, embed, norm, bias = NAMES
    v1_buckets = [[q, k], [v], [embed], [norm, bias]]
    v2_buckets = [[q, k, v], [embed], [norm, bias]]  # bf16 halves every size
    total_f32 = sum(torch.Size(s).numel() * 4 for s in SHAPES.values())
    for rank_out in results:  # every rank saw every full tensor and reports the same bytes
        assert rank_out["v1"]["weight_sync_bytes"] == total_f32
        assert rank_out["v2"]["weight_sync_bytes"] == total_f32 // 2
        assert rank_out["v1"]["weight_sync_buckets"] == 4 and rank_out["v2"]["weight_sync_buckets"] == 3
        assert rank_out["v1"]["weight_sync_time_s"] > 0
    for i, (snap1, snap2) in enumerate(zip(results[0]["after_v1"], results[0]["after_v2"])):
        group = snap1["state"]["group_requests"]
        assert [(g["rank_offset"], g["world_size"], g["backend"]) for g in group] == [(1 + i, 3, "gloo")]
        assert snap1["state"]["update_calls"] == v1_buckets
        assert snap1["state"]["version"] == "1"
        # SGLang sets the version after every bucket that carries one: only the last one does.
        assert snap1["state"]["versions_after_update"] == ["0", "0", "0", "1"]
        assert snap1["state"]["flushes"] == 1  # only the last bucket flushes the cache
        assert snap1["state"]["pauses"] == 1 and snap2["state"]["pauses"] == 1
        assert set(snap1["weights"]) == set(NAMES)
        for name in NAMES:
            assert snap1["weights"][name].dtype == torch.float32
            assert torch.equal(snap1["weights"][name], full_tensor(name, 0)), name
        assert snap2["state"]["update_calls"] == v1_buckets + v2_buckets
        assert snap2["state"]["load_formats"] == [None] * 4 + ["flattened_bucket"] * 3
        assert snap2["state"]["version"] == "2"
        assert snap2["state"]["versions_after_update"] == ["0", "0", "0", "1", "1", "1", "2"]
        for name in NAMES:
            assert snap2["weights"][name].dtype == torch.bfloat16
            assert torch.equal(snap2["weights"][name], full_tensor(name, 1).to(torch.bfloat16)), name


def test_a_flattened_bucket_holds_each_tensors_bytes_in_order():
    g = torch.Generator().manual_seed(0)
    # Odd sizes put the float32 and float64 tensors at offsets that are not multiples of their size.
    tensors = [
        torch.randn(3, generator=g).to(torch.bfloat16),
        torch.randn(5, 1, generator=g),
        torch.randn(2, 3, generator=g).double(),
        torch.randint(0, 100, (7,), generator=g),
        torch.tensor(2.5),
    ]
    flat = flatten_bucket(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == 6 + 20 + 48 + 56 + 4
    assert bucket_nbytes([t.dtype for t in tensors], [list(t.shape) for t in tensors]) == flat.numel()
    # Byte by byte what each tensor holds, in order (SGLang's FlattenedTensorBucket layout); a
    # bfloat16 is the upper half of its float32.
    bf16 = (tensors[0].float().numpy().view(np.uint32) >> 16).astype("<u2").tobytes()
    assert bytes(flat.tolist()) == bf16 + b"".join(t.numpy().tobytes() for t in tensors[1:])
    back = unflatten_bucket(flat, [t.dtype for t in tensors], [list(t.shape) for t in tensors])
    for got, want in zip(back, tensors):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    with pytest.raises(ValueError, match="cannot hold tensors of"):
        unflatten_bucket(flat[:-1], [t.dtype for t in tensors], [list(t.shape) for t in tensors])


def _disk_worker(addrs: list[str], folder: str) -> dict[str, Any]:
    client = RolloutClient(addrs, setup_timeout=300, backoff_s=0.01)
    engine = ShardedEngine(step=0)
    sync = build_weight_sync("disk", cast("WeightSyncEngine", engine), client, folder=folder)
    assert isinstance(sync, DiskWeightSync)
    sync.setup()
    out: dict[str, Any] = {"v1": sync.sync(1)}
    if dist.get_rank() == 0:
        out["after_v1"] = _snapshot(addrs)
        out["listing_v1"] = sorted(os.listdir(folder))
    engine.step = 1
    out["v2"] = sync.sync(2)
    if dist.get_rank() == 0:
        out["after_v2"] = _snapshot(addrs)
        out["listing_v2"] = sorted(os.listdir(folder))
        configure(addrs[1], fail_weight_update="cannot read checkpoint")
    try:
        sync.sync(3)
    except WeightSyncError as exc:
        out["v3_error"] = str(exc)
    if dist.get_rank() == 0:
        out["listing_v3"] = sorted(os.listdir(folder))
    client.close()
    return out


def test_disk_sync_publishes_versioned_folders(servers, tmp_path):
    folder = tmp_path / "weights"
    results = run_distributed(_disk_worker, 2, servers, str(folder), timeout=300)
    out = results[0]
    assert out["listing_v1"] == ["v1"] and out["listing_v2"] == ["v2"]  # no temp dirs, old version removed
    assert (
        results[1]["v1"]["weight_sync_bytes"]
        == out["v1"]["weight_sync_bytes"]
        > sum(torch.Size(s).numel() * 4 for s in SHAPES.values())
    )  # the safetensors file (with its header)
    # A server failing to load: every rank raises; the previous version stays until one succeeds.
    assert servers[1] in out["v3_error"] and "cannot read checkpoint" in out["v3_error"]
    assert results[1]["v3_error"].startswith("weight sync failed on trainer rank 0")
    assert out["listing_v3"] == ["v2", "v3"]
    for step, key in ((0, "after_v1"), (1, "after_v2")):
        for snap in out[key]:
            assert snap["state"]["disk_loads"][-1] == str(folder / f"v{step + 1}")
            assert snap["state"]["version"] == str(step + 1)
            for name in NAMES:
                assert torch.equal(snap["weights"][name], full_tensor(name, step)), name


class _LateThreads:
    """Stands in for the threading module of archon.rollout.weight_sync: a thread's target runs only
    once the sync abandoned its group (the interleaving of a server that refuses before the
    broadcast thread is scheduled)."""

    def __init__(self, sync: DistributedWeightSync):
        self.sync = sync

    def Thread(self, target, **kw) -> threading.Thread:  # noqa: N802 - the name it replaces
        def late() -> None:
            wait_until(lambda: self.sync._pg is None, "the weight-update group to be abandoned", timeout=60)
            target()

        return threading.Thread(target=late, **kw)


def _failing_bucket_worker(addrs: list[str], late_broadcast: bool) -> str:
    client = RolloutClient(addrs, setup_timeout=300, backoff_s=0.01)
    sync = DistributedWeightSync(
        cast("WeightSyncEngine", ShardedEngine()),
        client,
        chunk_mb=1,
        backend="gloo",
        master_address="127.0.0.1",
        group_name=f"wsync_fail_bucket_{late_broadcast}",
    )
    sync.setup()
    if late_broadcast and dist.get_rank() == 0:
        weight_sync_module.threading = _LateThreads(sync)  # type: ignore[assignment] - this forked rank only
    if dist.get_rank() == 0:
        configure(addrs[1], fail_weight_update="out of GPU memory")
    try:
        sync.sync(1)
    except WeightSyncError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("late_broadcast", [False, True])
def test_a_server_refusing_a_bucket_fails_every_rank(servers, late_broadcast):
    # late_broadcast: the broadcasts are issued after the refusal abandoned the group; they must not
    # fall back to the trainer's default group (group=None), where rank 1 waits in an all_gather.
    msgs = run_distributed(_failing_bucket_worker, 2, servers, late_broadcast, timeout=120)
    assert servers[1] in msgs[0] and "out of GPU memory" in msgs[0]
    assert msgs[1].startswith("weight sync failed on trainer rank 0:") and "out of GPU memory" in msgs[1]


def _half_sync_worker(addrs: list[str]) -> dict[str, Any]:
    client = RolloutClient(addrs, setup_timeout=30, backoff_s=0.01)
    sync = DistributedWeightSync(
        cast("WeightSyncEngine", ShardedEngine(step=2)),
        client,
        chunk_mb=1,
        backend="gloo",
        master_address="127.0.0.1",
        group_name="wsync_half",
    )
    sync.setup()
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        out["before"] = [fetch_state(a)["version"] for a in addrs]
        configure(addrs[1], fail_after_buckets=2)  # buckets 1 and 2 arrive, bucket 3 of 4 fails
    try:
        sync.sync("half")
        out["error"] = "no error"
    except WeightSyncError as exc:
        out["error"] = str(exc)
    if dist.get_rank() == 0:
        out["after"] = [fetch_state(a) for a in addrs]
    return out


def test_a_sync_failing_half_way_keeps_the_old_version(servers):
    out = run_distributed(_half_sync_worker, 2, servers, timeout=120)[0]
    assert "fake bucket failure" in out["error"]
    # Half of the buckets reached the servers, yet none reports the new version on those weights.
    assert [s["version"] for s in out["after"]] == out["before"]
    assert "half" not in out["after"][1]["versions_after_update"]
    assert len(out["after"][1]["update_calls"]) >= 2


def _refused_setup_worker(addrs: list[str]) -> list[str]:
    client = RolloutClient(addrs, setup_timeout=300, backoff_s=0.01)
    sync = DistributedWeightSync(
        cast("WeightSyncEngine", ShardedEngine()),
        client,
        chunk_mb=1,
        backend="gloo",
        master_address="127.0.0.1",
        group_name="wsync_refused",
    )
    msgs = []
    for step in (sync.setup, lambda: sync.sync(1)):
        try:
            step()
            msgs.append("no error")
        except WeightSyncError as exc:
            msgs.append(str(exc))
    return msgs


def test_servers_refusing_the_group_fail_fast(servers):
    configure(servers[0], fail_weight_update="nccl version mismatch")
    msgs = run_distributed(_refused_setup_worker, 2, servers, timeout=300)  # below the 600 s join timeout
    (setup0, sync0), (setup1, sync1) = msgs
    assert "did not join weight-update group 'wsync_refused'" in setup0 and servers[0] in setup0
    assert "nccl version mismatch" in setup1
    assert "call setup() first" in sync0 and "call setup() first" in sync1  # every rank, no hang


def test_factory_and_dtype_names():
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(torch.float32) == "float32"
    with pytest.raises(ValueError, match="needs a folder"):
        build_weight_sync("disk", cast("WeightSyncEngine", ShardedEngine()), None)
    with pytest.raises(ValueError, match="must be 'distributed', 'disk' or 'tensor'"):
        build_weight_sync("nfs", ShardedEngine(), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight_chunk_mb = 0 must be positive"):
        build_weight_sync("distributed", cast("WeightSyncEngine", ShardedEngine()), None, chunk_mb=0)


class _OneProcessEngine:
    """The trainer as one process (no trainer group): full tensors as they are."""

    def named_full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in NAMES:
            yield name, full_tensor(name, 0)

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        raise AssertionError("not a disk sync")


def test_a_refused_first_bucket_is_reported_where_the_transport_connects_lazily(tmp_path, monkeypatch):
    """NCCL connects a group inside its first collective, and that call blocks until every rank joined
    (gloo connects when the group forms); a server that refuses the first bucket never joins.  The
    broadcast below behaves so: the sync must report the server's error instead of waiting in the call."""
    port = free_ports(1)[0]
    spec = LaunchSpec(0, fake_command(port, "--health-delay-s", "0"), {}, "127.0.0.1", port, tmp_path / "server.log")
    with RolloutLauncher([spec], setup_timeout=300) as launcher:
        client = RolloutClient(launcher.addrs, setup_timeout=60, backoff_s=0.01)
        sync = DistributedWeightSync(
            cast("WeightSyncEngine", _OneProcessEngine()),
            client,
            chunk_mb=1,
            backend="gloo",
            master_address="127.0.0.1",
            group_name="wsync_lazy",
        )
        sync.setup()
        configure(launcher.addrs[0], fail_weight_update="shapes do not match the model")
        never_connects = threading.Event()
        broadcast = dist.broadcast

        def lazily_connecting_broadcast(tensor, src=0, group=None, async_op=False):
            if group is not None and group is sync._pg:
                never_connects.wait()  # the refusing server never calls its side
            return broadcast(tensor, src=src, group=group, async_op=async_op)

        monkeypatch.setattr(dist, "broadcast", lazily_connecting_broadcast)
        outcome: dict[str, BaseException | None] = {}

        def run() -> None:
            try:
                sync.sync(1)
                outcome["error"] = None
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(120)  # far below the group's 600 s timeout: the refusal must end the sync
        assert not thread.is_alive(), "the weight sync waited in a broadcast that could never connect"
        error = outcome["error"]
        assert isinstance(error, WeightSyncError) and "shapes do not match the model" in str(error)
        assert sync._pg is None  # abandoned: the next sync asks for setup() again
        client.close()


def test_the_weight_group_backend_is_chosen_from_both_ends():
    assert weight_group_backend("sglang", "cuda") == "nccl"
    assert weight_group_backend("local", "cuda") == "gloo"  # the built-in server has no GPU
    assert weight_group_backend("sglang", "cpu") == "gloo"
    # What the trainer builds for a CUDA actor: gloo to the built-in server, buckets staged on the CPU.
    engine = cast("WeightSyncEngine", _OneProcessEngine())
    local = weight_sync_for(load_config(None, ["rollout.backend=local:d1"]), engine, None, "cuda")
    assert isinstance(local, DistributedWeightSync) and local.backend == "gloo" and local.device == torch.device("cpu")
    assert local.flattened and local.extras  # the built-in server takes flattened buckets and the routing bias
    sglang = weight_sync_for(
        load_config(None, ["rollout.backend=sglang:d1", "sglang.dtype=bfloat16"]), engine, None, "cpu"
    )
    assert isinstance(sglang, DistributedWeightSync) and sglang.backend == "gloo" and sglang.dtype == torch.bfloat16
    vllm = weight_sync_for(
        load_config(None, ["rollout.backend=vllm:d1", "rollout.weight_sync=disk"]), engine, None, "cuda"
    )
    assert isinstance(vllm, DiskWeightSync) and vllm.untie_embeddings
