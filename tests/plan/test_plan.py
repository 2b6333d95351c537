"""The cluster plan: every process's node, GPUs and role; the GPU a training rank selects; bad layouts."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from paths import REPO

from archon.alloc import AllocationError, ModelAllocation
from archon.cli import init_run
from archon.config import ConfigError, load_config
from archon.engine import dist as archon_dist
from archon.plan import ClusterPlan, Job, plan_cluster, plan_for_config

DENSE = REPO / "configs" / "qwen3_8b_dense.toml"
MOE = REPO / "configs" / "qwen3_30b_a3b_moe.toml"


def allocs(**kw):
    return {k: ModelAllocation.from_str(v) for k, v in kw.items()}


def check_invariants(plan: ClusterPlan, server_size: int) -> None:
    """No GPU twice; servers whole on one node; training ranks in order, after the servers of their node."""
    owners: dict[tuple[int, int], str] = {}
    for p in plan.processes:
        for g in p.gpus:
            assert 0 <= g < plan.n_gpus_per_node and 0 <= p.node < plan.n_nodes
            assert (p.node, g) not in owners, f"{p.name} and {owners[(p.node, g)]} share GPU {g} of node {p.node}"
            owners[(p.node, g)] = p.name
    for s in plan.servers:
        assert len(s.gpus) == server_size and list(s.gpus) == list(range(s.gpus[0], s.gpus[0] + server_size))
    slots = [(p.node, p.gpus[0]) for p in plan.train_ranks]
    assert [p.index for p in plan.train_ranks] == list(range(len(slots)))
    assert slots == sorted(slots), "training ranks must run in node, then GPU order"
    for node, gpu in slots:  # rollout first, then training: on a shared node, training takes the GPUs after
        assert all(gpu > s.gpus[-1] for s in plan.servers_on(node)), "a training rank before a server"
    for node in plan.train_nodes:
        ranks = plan.train_ranks_on(node)
        assert [p.local_index for p in ranks] == list(range(len(ranks)))
        assert [p.index for p in ranks] == list(range(plan.first_rank(node), plan.first_rank(node) + len(ranks)))


# ---------------------------------------------------------------------------------- layouts


def test_dense_recipe_gives_rollout_a_whole_node_and_training_the_other_two():
    cfg = load_config(DENSE)
    plan = plan_for_config(cfg)
    check_invariants(plan, 2)
    assert [(s.node, s.gpus) for s in plan.servers] == [(0, (0, 1)), (0, (2, 3)), (0, (4, 5)), (0, (6, 7))]
    assert plan.rollout_nodes == (0,) and plan.train_nodes == (1, 2) and plan.shared_nodes == ()
    assert plan.train_gpus(1) == plan.train_gpus(2) == tuple(range(8))
    assert (plan.first_rank(1), plan.first_rank(2)) == (0, 8)
    assert plan.rank(9).node == 2 and plan.rank(9).gpus == (1,) and plan.rank(9).local_index == 1
    assert plan.used_gpus == plan.total_gpus == 24
    assert (plan.rollout, plan.train) == ("sglang:d4t2", "archon:d4p2t2")


def test_moe_recipe_is_placed_rollout_on_nodes_0_1_training_on_2_3():
    cfg = load_config(MOE)
    plan = plan_for_config(cfg)
    check_invariants(plan, 4)
    assert [(s.node, s.gpus) for s in plan.servers] == [
        (0, (0, 1, 2, 3)),
        (0, (4, 5, 6, 7)),
        (1, (0, 1, 2, 3)),
        (1, (4, 5, 6, 7)),
    ]
    assert plan.rollout_nodes == (0, 1) and plan.train_nodes == (2, 3)
    assert [len(plan.on_node(n)) for n in range(4)] == [2, 2, 8, 8]
    assert cfg.actor.gradient_checkpointing and cfg.actor.archon.pp_schedule == "Interleaved1F1B"


def test_one_node_shares_it_servers_first_then_training():
    plan = plan_cluster(allocs(rollout="sglang:d4", actor="archon:d4"), 1, 8)
    check_invariants(plan, 1)
    assert [s.gpus for s in plan.servers] == [(0,), (1,), (2,), (3,)]
    assert plan.train_gpus(0) == (4, 5, 6, 7) and plan.shared_nodes == (0,)
    assert [p.local_index for p in plan.train_ranks] == [0, 1, 2, 3]
    assert plan.idle_gpus(0) == ()


def test_whole_nodes_for_rollout_only_when_training_still_fits():
    # 2 nodes of 8: rollout needs 4 GPUs, training 12; whole nodes would leave training 8, so node 0 is shared.
    plan = plan_cluster(allocs(rollout="sglang:d2t2", actor="archon:d12"), 2, 8)
    check_invariants(plan, 2)
    assert plan.train_gpus(0) == (4, 5, 6, 7) and plan.train_gpus(1) == tuple(range(8))
    # Servers of 3 on nodes of 8 leave 2 GPUs of each rollout node; packed, training uses them.
    plan = plan_cluster(allocs(rollout="sglang:d4t3", actor="archon:d4"), 2, 8)
    check_invariants(plan, 3)
    assert [(s.node, s.gpus[0]) for s in plan.servers] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert [(p.node, p.gpus[0]) for p in plan.train_ranks] == [(0, 6), (0, 7), (1, 6), (1, 7)]


def test_sft_counts_training_ranks_only():
    moe = "actor.backend='archon:(attn:d1p4t2c2|ffn:d1p4t1e4)'"
    two_nodes = ["cluster.n_nodes=2", "cluster.n_gpus_per_node=8", moe]
    with pytest.raises(ConfigError, match="together 17"):
        load_config(None, two_nodes)  # RL: the default local:d1 server takes a slot too
    cfg = load_config(None, two_nodes, job="sft")
    plan = plan_for_config(cfg, "sft")
    assert plan.servers == () and plan.train_nodes == (0, 1) and plan.train_gpus(1) == tuple(range(8))


def test_training_engines_must_share_world_size():
    plan = plan_cluster(allocs(rollout="local:d1", actor="archon:d2t2", ref="archon:d4"), 1, 5)
    assert plan.train_gpus(0) == (1, 2, 3, 4)
    with pytest.raises(
        AllocationError, match="actor.backend 'archon:d2t2' needs 4 ranks but critic.backend 'archon:d2' needs 2"
    ):
        plan_cluster(allocs(actor="archon:d2t2", critic="archon:d2"), 1, 8)


# ---------------------------------------------------------------------------------- bad input


def test_a_layout_larger_than_the_cluster_is_one_sentence():
    with pytest.raises(AllocationError) as info:
        plan_cluster(allocs(rollout="sglang:d4t2", actor="archon:d4p2t2"), 2, 8)
    msg = str(info.value)
    assert "needs 8 devices" in msg and "needs 16" in msg and "together 24" in msg and "gives 16" in msg
    assert msg.count(". ") == 0 and "\n" not in msg


def test_a_server_larger_than_a_node_is_refused():
    with pytest.raises(
        AllocationError,
        match=r"gives each server 16 GPUs \(t\*p\), more than a node's "
        r"cluster.n_gpus_per_node=8.*never spans nodes",
    ):
        plan_cluster(allocs(rollout="sglang:d1t16", actor="archon:d8"), 4, 8)


def test_servers_that_do_not_pack_into_nodes_are_refused():
    # 15 + 1 GPUs of 16, but a node of 8 holds only 2 whole servers of 3, so 2 nodes hold 4 of the 5.
    with pytest.raises(
        AllocationError,
        match="needs 5 servers of 3 GPUs, but a node of 8 GPUs holds 2 whole servers, 4 on cluster.n_nodes=2",
    ):
        plan_cluster(allocs(rollout="sglang:d5t3", actor="archon:d1"), 2, 8)


# ---------------------------------------------------------------------------------- GPU selection


class FakeCuda:
    """torch.cuda as a node with ``count`` visible GPUs; remembers the device set."""

    def __init__(self, count: int):
        self.count = count
        self.current = 0

    def set_device(self, index: int) -> None:
        self.current = index

    def patches(self):
        return [
            mock.patch.object(torch.cuda, "is_available", return_value=True),
            mock.patch.object(torch.cuda, "device_count", return_value=self.count),
            mock.patch.object(torch.cuda, "set_device", side_effect=self.set_device),
            mock.patch.object(torch.cuda, "current_device", side_effect=lambda: self.current),
            mock.patch.object(archon_dist.dist, "is_initialized", return_value=False),
            mock.patch.object(archon_dist.dist, "init_process_group"),
        ]


def selected_device(env: dict[str, str], count: int = 8, cfg=None, plan=None, job: Job = "rl") -> torch.device:
    """The device the engine computes on after the entry point's init, with CUDA and the process group mocked."""
    fake = FakeCuda(count)
    with mock.patch.dict("os.environ", env, clear=False):
        for key in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK"):
            if key not in env:
                import os

                os.environ.pop(key, None)
        patches = fake.patches()
        for p in patches:
            p.start()
        try:
            if cfg is not None:
                assert init_run(cfg, job) == "cuda"
            else:
                archon_dist.init_distributed("cuda", plan=plan)
            return archon_dist.current_device("cuda")
        finally:
            for p in patches:
                p.stop()


def torchrun_env(rank: int, local: int, world: int, **extra: str) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world), **extra}


def test_one_node_torchrun_puts_ranks_after_the_servers_without_env_vars():
    cfg = load_config(
        None, ["rollout.backend=sglang:d2t2", "actor.backend=archon:d4", "device=cuda", "cluster.n_gpus_per_node=8"]
    )
    got = [selected_device(torchrun_env(r, r, 4), cfg=cfg).index for r in range(4)]
    assert got == [4, 5, 6, 7]
    plan = plan_for_config(cfg)
    assert [p.gpus for p in plan.servers] == [(0, 1), (2, 3)]
    assert got == [p.gpus[0] for p in plan.train_ranks]
    # SFT of the same config starts no server: ranks take GPUs 0-3.
    assert [selected_device(torchrun_env(r, r, 4), cfg=cfg, job="sft").index for r in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["dense", "moe"])
def test_recipe_ranks_select_the_plan_gpus_however_the_launcher_exports_them(path):
    plan = plan_for_config(load_config(path))
    world = plan.train_world_size
    for p in plan.train_ranks:
        env = torchrun_env(p.index, p.local_index, world)
        # Nothing exported: the plan's GPU id is the device index.
        assert selected_device(env, plan=plan) == torch.device("cuda", p.gpus[0])
        # A launcher that shows each node its training GPUs (Slurm): the id's position in the list.
        node_list = ",".join(map(str, plan.train_gpus(p.node)))
        dev = selected_device({**env, "CUDA_VISIBLE_DEVICES": node_list}, count=len(plan.train_gpus(p.node)), plan=plan)
        assert dev.index == plan.train_gpus(p.node).index(p.gpus[0]) == p.local_index
        # One GPU per process under another name (Ray bundles): the one visible GPU.
        assert selected_device({**env, "CUDA_VISIBLE_DEVICES": "GPU-1a2b"}, count=1, plan=plan).index == 0


def test_a_job_holding_part_of_a_node_maps_plan_gpus_through_its_device_list():
    # A container or a partial-node job sees its 4 GPUs as physical 4-7, renumbered 0-3; the plan numbers them 0-3.
    cfg = load_config(None, ["rollout.backend=sglang:d2", "actor.backend=archon:d2", "cluster.n_gpus_per_node=4"])
    plan = plan_for_config(cfg)
    got = [
        selected_device(torchrun_env(p.index, p.local_index, 2, CUDA_VISIBLE_DEVICES="4,5,6,7"), count=4, plan=plan)
        for p in plan.train_ranks
    ]
    assert [d.index for d in got] == [p.gpus[0] for p in plan.train_ranks] == [2, 3]  # physical GPUs 6 and 7


def test_auto_says_loudly_when_nvidia_smi_sees_gpus_this_torch_cannot_use(tmp_path, monkeypatch, caplog):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 470.57.02'\necho 'NVIDIA H100 80GB HBM3, 470.57.02'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("PATH", f"{tmp_path}:{archon_dist.os.environ['PATH']}")
    with caplog.at_level("WARNING", logger="archon.engine"):
        assert archon_dist.resolve_device_type("auto") == "cpu"
    (record,) = [r for r in caplog.records if "nvidia-smi lists" in r.getMessage()]
    message = record.getMessage()
    assert "lists 2 GPU(s) (NVIDIA H100 80GB HBM3, 470.57.02)" in message and "install a torch built" in message
    caplog.clear()
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: a CPU machine, nothing to say
    with caplog.at_level("WARNING", logger="archon.engine"):
        assert archon_dist.resolve_device_type("auto") == "cpu"
    assert not caplog.records


def test_no_plan_keeps_torchrun_local_rank():
    assert selected_device(torchrun_env(3, 3, 4)).index == 3


def test_selection_errors_are_one_sentence():
    plan = plan_cluster(allocs(rollout="sglang:d4", actor="archon:d4"), 1, 8)
    with pytest.raises(
        archon_dist.DeviceSelectionError,
        match="started as local rank 1, but the cluster plan puts it on node 0 as local rank 2",
    ):
        selected_device(torchrun_env(2, 1, 4), plan=plan)
    with pytest.raises(
        archon_dist.DeviceSelectionError,
        match=r"GPU 6 of its node, but CUDA_VISIBLE_DEVICES='0,1,2,3'"
        " does not list it",
    ):
        selected_device(torchrun_env(2, 2, 4, CUDA_VISIBLE_DEVICES="0,1,2,3"), count=4, plan=plan)
    with pytest.raises(archon_dist.DeviceSelectionError, match="should use CUDA device 5 .* only 4 are visible"):
        selected_device(torchrun_env(1, 1, 4), count=4, plan=plan)
    with pytest.raises(ValueError, match="training rank 4 is not in the plan, which has 4"):
        selected_device(torchrun_env(4, 4, 5), plan=plan)


def test_launcher_starts_servers_on_the_plan_gpus_and_training_takes_the_rest(tmp_path):
    from archon.launch.servers import build_launch_specs

    cfg = load_config(None, ["rollout.backend=sglang:d2t2", "actor.backend=archon:d4", "actor.path=/models/x"])
    specs = build_launch_specs(cfg, tmp_path, ports=[30000, 30001])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    assert plan_for_config(cfg).train_gpus(0) == (4, 5, 6, 7)


def test_cli_prints_the_plan_table_and_the_memory_verdict(capsys, monkeypatch):
    import json

    from archon.plan.show import main

    monkeypatch.chdir(REPO)
    run = lambda *a: (main(["--config", str(MOE), *a]), *capsys.readouterr())  # noqa: E731
    code, out, err = run()
    assert code == 0, err
    assert "server 3 (sglang:d4t4)" in out and "rank 15 (pp3 cp1 tp1)" in out
    assert "fits," in out and "the run fits on 80 GiB GPUs" in out
    code, out, _ = run("--json")
    data = json.loads(out)
    assert code == 0 and data == plan_for_config(load_config(MOE)).to_dict()
    assert data["processes"][4] == {"role": "train", "index": 0, "node": 2, "gpus": [0], "local_index": 0}
    code, out, _ = run("cluster.gpu_memory_gb=40")
    assert code == 1 and "does not fit" in out and "the run does not fit" in out
    code, _, err = run("cluster.n_nodes=3")
    assert code == 2 and "Traceback" not in err and "gives 24" in " ".join(err.split())
