"""Colocated layouts: servers on the training ranks' GPUs, the in-process backend's plan, what the plan prints."""

from __future__ import annotations

import json

import pytest
from paths import REPO

from archon.alloc import AllocationError, ModelAllocation
from archon.config import load_config
from archon.plan import plan_cluster, plan_for_config
from archon.plan.fit import check_fit
from archon.plan.memory import GiB, MiB
from archon.plan.params import model_args_of, param_groups, read_model_config
from archon.plan.show import main as plan_main


def allocs(**kw):
    return {k: ModelAllocation.from_str(v) for k, v in kw.items()}


def rank_slot(rank: int, gpus_per_node: int) -> tuple[int, int]:
    """Where a training rank goes when nothing else takes a GPU: node by node, GPU 0 first."""
    return divmod(rank, gpus_per_node)


@pytest.mark.parametrize(
    "rollout, train, n_nodes, per_node",
    [
        ("sglang:d1", "archon:d1", 1, 1),  # one GPU
        ("sglang:d4t2", "archon:d8", 1, 8),
        ("sglang:d4t4", "archon:d4p2t2", 2, 8),
        ("vllm:d2t2p2", "archon:d8", 2, 4),
        ("local:d2", "archon:d2", 1, 2),  # CPU: the built-in servers take no slot of their own
    ],
)
def test_server_i_runs_on_the_gpus_of_training_ranks_i_size_on(rollout, train, n_nodes, per_node):
    plan = plan_cluster(allocs(rollout=rollout, actor=train), n_nodes, per_node, colocate=True)
    alloc = ModelAllocation.from_str(rollout)
    size = alloc.parallel.tp_size * alloc.parallel.pp_size
    world = ModelAllocation.from_str(train).world_size
    assert plan.colocated and plan.train_world_size == world and len(plan.servers) == alloc.parallel.dp_size
    for r in plan.train_ranks:  # training ranks are placed as if they were alone
        node, gpu = rank_slot(r.index, per_node)
        assert (r.node, r.gpus, r.local_index) == (node, (gpu,), gpu)
    for s in plan.servers:
        ranks = range(s.index * size, (s.index + 1) * size)
        assert plan.colocated_ranks(s) == tuple(ranks)
        assert s.node == rank_slot(ranks[0], per_node)[0]
        assert s.gpus == tuple(rank_slot(r, per_node)[1] for r in ranks)
    assert plan.used_gpus == world  # a shared GPU counts once
    assert plan.shared_nodes == plan.train_nodes == plan.rollout_nodes


def test_colocated_servers_are_numbered_per_node_and_listed_in_the_plan_dict():
    plan = plan_cluster(allocs(rollout="sglang:d4t4", actor="archon:d16"), 2, 8, colocate=True)
    assert [(s.node, s.gpus, s.local_index) for s in plan.servers] == [
        (0, (0, 1, 2, 3), 0),
        (0, (4, 5, 6, 7), 1),
        (1, (0, 1, 2, 3), 0),
        (1, (4, 5, 6, 7), 1),
    ]
    data = plan.to_dict()
    assert data["colocated"] is True and len(data["processes"]) == 4 + 16
    servers = [p for p in data["processes"] if p["role"] == "rollout"]
    assert servers[2]["colocated_with_ranks"] == [8, 9, 10, 11]
    assert all("colocated_with_ranks" not in p for p in data["processes"] if p["role"] == "train")


def test_a_layout_that_needs_its_own_gpus_is_still_refused_without_colocation():
    with pytest.raises(AllocationError, match="together 2, but cluster.n_nodes=1 x cluster.n_gpus_per_node=1"):
        plan_cluster(allocs(rollout="sglang:d1", actor="archon:d1"), 1, 1)
    plan = plan_cluster(allocs(rollout="sglang:d1", actor="archon:d1"), 1, 2)
    assert not plan.colocated and plan.to_dict()["colocated"] is False
    assert [p.gpus for p in plan.processes] == [(0,), (1,)] and plan.colocated_ranks(plan.servers[0]) == ()


@pytest.mark.parametrize(
    "rollout, train, n_nodes, per_node, message",
    [
        ("sglang:d2", "archon:d4", 1, 4, r"'sglang:d2' \(2 GPUs\) must use exactly the GPUs of the training ranks"),
        ("vllm:d2t3", "archon:d6", 2, 4, "server 1 of 'vllm:d2t3' would run on training ranks 3-5, which span nodes"),
        ("sglang:d1t8", "archon:d8", 2, 4, "gives each server 8 GPUs"),
        ("sglang:d8", "archon:d8", 1, 4, "training 'archon:d8' needs 8 devices"),
    ],
)
def test_colocated_layouts_that_cannot_run_are_one_sentence(rollout, train, n_nodes, per_node, message):
    with pytest.raises(AllocationError, match=message):
        plan_cluster(allocs(rollout=rollout, actor=train), n_nodes, per_node, colocate=True)


def test_the_in_process_backend_places_no_rollout_process():
    plan = plan_cluster(allocs(rollout="inprocess:d2", actor="archon:d2"), 1, 2)
    assert plan.servers == () and [r.gpus for r in plan.train_ranks] == [(0,), (1,)]
    assert (plan.rollout, plan.train, plan.colocated) == ("inprocess:d2", "archon:d2", False)
    assert plan.rollout_nodes == () and plan.used_gpus == 2


def test_plan_for_config_follows_rollout_colocate_for_rl_only():
    cfg = load_config(overrides=["rollout.backend=sglang:d2", "actor.backend=archon:d2", "rollout.colocate=true"])
    assert plan_for_config(cfg).colocated
    sft = plan_for_config(cfg, "sft")
    assert not sft.colocated and sft.servers == ()


def test_python_m_archon_plan_says_which_ranks_each_server_shares(capsys):
    argv = ["rollout.backend=sglang:d2t2", "actor.backend=archon:d4", "rollout.colocate=true"]
    assert plan_main([*argv, "cluster.n_gpus_per_node=4"]) == 0  # no model config: the memory check is skipped
    out = capsys.readouterr().out
    assert "server 0 (sglang:d2t2), colocated with training ranks 0-1" in out
    assert "server 1 (sglang:d2t2), colocated with training ranks 2-3" in out
    assert "take turns on the same GPUs" in out and "idle" not in out
    assert plan_main(["--json", *argv, "cluster.n_gpus_per_node=4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["colocated"] and data["processes"][1]["colocated_with_ranks"] == [2, 3]
    assert plan_main(["rollout.backend=inprocess:d2", "actor.backend=archon:d2"]) == 0
    out = capsys.readouterr().out
    assert "generates inside each training rank" in out and "│ rollout" not in out  # no server row


# ---------------------------------------------------------------------------------- memory phases

QWEN3_8B = ["actor.model_config=configs/models/qwen3_8b", "actor.archon.enable_compile=false"]


def _colocated_report(*extra: str):
    layout = ["rollout.backend=sglang:d8", "actor.backend=archon:d8", "rollout.colocate=true", "cluster.n_nodes=1"]
    return check_fit(load_config(overrides=[*QWEN3_8B, *layout, *extra]))


def test_a_colocated_gpu_is_checked_in_both_phases_with_hand_computed_residents(monkeypatch):
    monkeypatch.chdir(REPO)
    spec, args = model_args_of(read_model_config(REPO / "configs" / "models" / "qwen3_8b"))
    n = sum(g.numel for g in param_groups(spec, args))
    usable = 80 * GiB * 79.11 / 80
    static = 0.5 * usable  # sglang.mem_fraction_static's colocated default: weights + KV cache
    # Between steps a rank of archon:d8 keeps its float32 eighth of the parameters (4 N / 8) and AdamW's two moments
    # (8 N / 8), the FSDP group's NCCL buffers (1 GiB), its CUDA context (512 MiB), cuBLAS (2 x 32 MiB) and the
    # default group's NCCL buffers (1 GiB); the server adds its own CUDA context (512 MiB).
    buffers = GiB + 512 * MiB + 64 * MiB + GiB
    report = _colocated_report()
    assert report.generating is not None and report.rollout is not None and report.train is not None
    assert report.generating.total == pytest.approx(static + 512 * MiB + 12 * n / 8 + buffers, abs=8)
    offloaded = _colocated_report("actor.offload=true")
    assert offloaded.generating is not None
    assert offloaded.generating.total == pytest.approx(static + 512 * MiB + buffers, abs=8)
    # Training: the separate layout's training rank plus the released server's CUDA context (weights and KV: 0).
    separate_layout = ["rollout.backend=sglang:d8", "actor.backend=archon:d8", "cluster.n_nodes=2"]
    separate = check_fit(load_config(overrides=[*QWEN3_8B, *separate_layout]))
    assert separate.train is not None and separate.generating is None
    assert report.train.total == separate.train.total + 512 * MiB
    assert report.fits and report.estimates == [report.train, report.generating, report.rollout]


def test_a_generating_phase_that_overflows_the_gpu_is_a_misfit_that_offload_fixes(monkeypatch):
    monkeypatch.chdir(REPO)
    tight = ("sglang.mem_fraction_static=0.85",)
    report = _colocated_report(*tight)
    assert report.generating is not None and not report.fits_generating() and not report.fits
    verdict = report.verdict(report.generating)
    assert verdict.startswith("does not fit") and "set actor.offload = true" in verdict
    assert _colocated_report(*tight, "actor.offload=true").fits_generating()


def test_python_m_archon_plan_prints_both_phases(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    argv = [*QWEN3_8B, "rollout.backend=sglang:d8", "actor.backend=archon:d8", "rollout.colocate=true"]
    plan_main(argv)
    out = capsys.readouterr().out
    assert "colocated GPU, training (training rank)" in out and "colocated GPU, generating (rollout server GPU" in out
    assert "trainer optimizer state (AdamW, float32)" in out and "server weights and KV cache (released" in out
