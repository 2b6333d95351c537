import pytest

from archon.alloc import AllocationError, ModelAllocation
from archon.plan import check_cluster_fit


def allocs(**kw):
    return {k: ModelAllocation.from_str(v) for k, v in kw.items()}


def test_seed_dense_example_fits_24_gpus():
    plan = check_cluster_fit(allocs(rollout="sglang:d4t2", actor="archon:d4p2t2", ref="archon:d4p2t2"), 3, 8)
    assert plan.rollout_devices == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.train_devices == tuple(range(8, 24))
    assert plan.used_devices == plan.total_devices == 24
    assert [(s.node, s.local_devices) for s in plan.servers] == [(0, (0, 1)), (0, (2, 3)), (0, (4, 5)), (0, (6, 7))]


def test_seed_moe_example_fits_32_gpus():
    plan = check_cluster_fit(allocs(rollout="sglang:d4t4", actor="archon:(attn:d1p4t2c2|ffn:d1p4t1e4)"), 4, 8)
    assert plan.rollout_devices == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [(s.node, s.local_devices) for s in plan.servers][2] == (1, (0, 1, 2, 3))
    assert plan.train_devices == tuple(range(16, 32))


def test_misfit_gives_the_arithmetic():
    with pytest.raises(AllocationError) as info:
        check_cluster_fit(allocs(rollout="sglang:d4t2", actor="archon:d4p2t2"), 2, 8)
    msg = str(info.value)
    assert "needs 8 devices" in msg and "needs 16" in msg and "together 24" in msg and "gives 16" in msg


def test_training_engines_must_share_world_size():
    plan = check_cluster_fit(allocs(rollout="local:d1", actor="archon:d2t2", ref="archon:d4"), 1, 5)
    assert plan.train_devices == (1, 2, 3, 4)
    with pytest.raises(AllocationError, match="actor.backend 'archon:d2t2' needs 4 ranks but critic.backend 'archon:d2' needs 2"):
        check_cluster_fit(allocs(actor="archon:d2t2", critic="archon:d2"), 1, 8)


def test_server_may_not_straddle_nodes():
    with pytest.raises(AllocationError, match="would span nodes 0 and 1"):
        check_cluster_fit(allocs(rollout="sglang:d2t3", actor="archon:d2"), 2, 4)


@pytest.mark.parametrize("name, rollout, actor, total, rollout_devices", [
    ("qwen3_8b_dense.toml", "sglang:d4t2", "archon:d4p2t2", 24, 8),
    ("qwen3_30b_a3b_moe.toml", "sglang:d4t4", "archon:(attn:d1p4t2c2|ffn:d1p4t1e4)", 32, 16),
])
def test_shipped_recipes_parse_and_fit_their_clusters(name, rollout, actor, total, rollout_devices):
    from pathlib import Path

    from archon.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / name)
    assert (cfg.rollout.backend, cfg.actor.backend) == (rollout, actor)
    plan = check_cluster_fit(cfg.allocations(), cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node)
    assert plan.total_devices == plan.used_devices == total
    assert sum(len(d) for d in plan.rollout_devices) == rollout_devices
    assert cfg.actor.gradient_checkpointing and cfg.actor.archon.pp_schedule == "Interleaved1F1B"
