"""The Ray launcher on a local Ray cluster of two simulated nodes (``ray.cluster_utils.Cluster``).

Each node declares 2 logical GPUs (Ray hands out their ids and sets CUDA_VISIBLE_DEVICES for
them as for real ones); the CPU demo's training ranks still compute on the CPU (device = cpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import pid_alive
from paths import REPO, helpers_pythonpath

from archon.config import load_config
from archon.plan import plan_for_config

ray = pytest.importorskip("ray")

DEMO = REPO / "configs" / "cpu_demo.toml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    c.add_node(num_cpus=2, num_gpus=2)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def demo_assets(tmp_path_factory):
    from archon.demos.first_letter import make_assets

    return make_assets(tmp_path_factory.mktemp("demo") / "assets")


def _overrides(assets, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "cluster.n_nodes=2",
        "cluster.n_gpus_per_node=2",
        f"actor.path={assets.model}",
        f"train_dataset.path={assets.train}",
        f"output_dir={out}",
        f"total_train_steps={steps}",
        "saver.export_hf=false",
        "reward.n_workers=0",
        *extra,
    ]


def _launch(cluster, overrides: list[str], timeout: float = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": helpers_pythonpath()}
    cmd = [
        sys.executable,
        "-m",
        "archon.launch",
        "ray",
        "--address",
        cluster.address,
        "--config",
        str(DEMO),
        *overrides,
    ]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _alive_nodes() -> int:
    return sum(1 for n in ray.nodes() if n["Alive"]) if ray.is_initialized() else 0


def test_demo_runs_with_its_server_on_one_node_and_training_on_the_other(cluster, demo_assets, tmp_path):
    out = tmp_path / "run"
    overrides = _overrides(demo_assets, out, 6)
    done = _launch(cluster, overrides)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    plan = plan_for_config(load_config(DEMO, overrides))
    placed = json.loads((out / "launch" / "ray_placement.json").read_text())
    assert [(p["role"], p["index"]) for p in placed] == [(p.role, p.index) for p in plan.processes]
    ray_node = {}
    for row, proc in zip(placed, plan.processes):
        # The GPU ids Ray gave the process, as the process itself saw them, are the plan's.
        assert row["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, proc.gpus)), row
        assert ray_node.setdefault(proc.node, row["ray_node_id"]) == row["ray_node_id"]
    assert ray_node[0] != ray_node[1]  # plan node 0 (the server) and node 1 (both ranks): two Ray nodes
    ids = {n["NodeID"] for n in _nodes(cluster)}
    assert set(ray_node.values()) == ids

    rewards = [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 6
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.05, rewards  # chance is ~0.07; it rises within a few steps
    assert "rollout servers published" in done.stdout + done.stderr
    for row in placed:
        assert not pid_alive(row["pid"]), row  # the launcher stopped everything it started


def _nodes(cluster) -> list[dict]:
    """The cluster's alive nodes, asked through a short-lived driver (the test process is not one)."""
    code = (
        f"import json, ray; ray.init(address={cluster.address!r}, log_to_driver=False); "
        "print(json.dumps([{'NodeID': n['NodeID']} for n in ray.nodes() if n['Alive']]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_failing_trainer_ends_the_run_with_its_log_and_stops_the_servers(cluster, demo_assets, tmp_path):
    # The trainer fails reading its data while the server is still starting: both must be gone at the end.
    out = tmp_path / "run"
    missing = tmp_path / "no_such_data.jsonl"
    done = _launch(cluster, _overrides(demo_assets, out, 2, f"train_dataset.path={missing}"))
    assert done.returncode == 1, (done.stdout + done.stderr)[-4000:]
    err = done.stderr.strip().splitlines()
    first = next(line for line in err if line.startswith("error: "))
    assert "training rank" in first and "exited with code 2" in first and "last lines of" in first
    assert str(missing) in done.stderr  # the trainer's own one-line reason, from its log
    for row in json.loads((out / "launch" / "ray_placement.json").read_text()):
        assert not pid_alive(row["pid"]), row


def test_a_plan_larger_than_the_ray_cluster_is_one_sentence(cluster, demo_assets, tmp_path):
    # Three nodes: the server on node 0, four training ranks on nodes 1 and 2; the Ray cluster has two.
    overrides = _overrides(demo_assets, tmp_path / "run", 1, "cluster.n_nodes=3", "actor.backend=archon:d4")
    done = _launch(cluster, overrides, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    err = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(err) == 1, done.stderr[-3000:]
    assert "the plan needs 3 node(s) with 1, 2, 2 GPUs" in err[0] and "add Ray nodes with GPUs" in err[0]


def test_ray_gives_a_colocated_server_and_its_rank_halves_of_the_same_gpu(cluster, tmp_path):
    from archon.launch.ray_cluster import RayLaunch

    overrides = [
        "actor.path=/models/tiny",
        "rollout.colocate=true",
        "rollout.backend=local:d2",
        "actor.backend=archon:d2",
        "cluster.n_gpus_per_node=2",
        "device=cpu",
        f"output_dir={tmp_path}",
    ]
    cfg = load_config(None, overrides)
    plan = plan_for_config(cfg)
    ray.init(address=cluster.address, log_to_driver=False)
    launch = RayLaunch(cfg, plan, None, overrides, cpus_per_gpu=0.5)
    try:
        launch.place()
        assert sorted(launch.slots) == [(0, 0, "rollout"), (0, 0, "train"), (0, 1, "rollout"), (0, 1, "train")]
        for s in plan.servers:
            (rank,) = plan.colocated_ranks(s)
            assert launch._visible(s) == launch._visible(plan.rank(rank)) != ""
        assert launch._visible(plan.rank(0)) != launch._visible(plan.rank(1))
    finally:
        launch.stop()
        ray.shutdown()
