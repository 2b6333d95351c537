"""Launching colocated servers: their command lines and devices, the Slurm steps; inprocess (the Ray slots are in
test_ray.py, on its Ray cluster)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from paths import REPO

from archon.config import Config, load_config
from archon.launch.servers import build_launch_specs
from archon.launch.slurm import build_job, dry_run_text, render_script
from archon.plan import plan_for_config

COLOCATED = ["actor.path=/models/tiny", "rollout.colocate=true"]


def _cfg(*overrides: str) -> Config:
    return load_config(None, [*COLOCATED, *overrides])


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_colocated_sglang_servers_get_their_ranks_gpus_the_memory_saver_and_half_the_gpu(tmp_path):
    cfg = _cfg("rollout.backend=sglang:d2t2", "actor.backend=archon:d4", "cluster.n_gpus_per_node=4")
    specs = build_launch_specs(cfg, tmp_path, ports=[1, 2])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]  # ranks 0-1 and 2-3
    for s in specs:
        assert s.cmd[:3] == [sys.executable, "-m", "sglang.launch_server"] and s.cmd.count("--enable-memory-saver") == 1
        assert _flag(s.cmd, "--mem-fraction-static") == "0.5"
    explicit = _cfg(
        "rollout.backend=sglang:d1", "sglang.mem_fraction_static=0.6", "sglang.extra_args=['--enable-memory-saver']"
    )
    (spec,) = build_launch_specs(explicit, tmp_path, ports=[1])
    assert _flag(spec.cmd, "--mem-fraction-static") == "0.6" and spec.cmd.count("--enable-memory-saver") == 1
    separate = load_config(None, ["actor.path=/models/tiny", "rollout.backend=sglang:d1"])
    (spec,) = build_launch_specs(separate, tmp_path, ports=[1])
    assert "--enable-memory-saver" not in spec.cmd and _flag(spec.cmd, "--mem-fraction-static") == "0.8"


def test_colocated_vllm_servers_sleep_between_phases_and_leave_half_the_gpu(tmp_path):
    cfg = _cfg(
        "rollout.backend=vllm:d2t2", "actor.backend=archon:d4", "cluster.n_gpus_per_node=4", "rollout.weight_sync=disk"
    )
    specs = build_launch_specs(cfg, tmp_path, ports=[1, 2])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    for s in specs:
        assert "--enable-sleep-mode" in s.cmd and _flag(s.cmd, "--gpu-memory-utilization") == "0.5"
        assert s.env["VLLM_SERVER_DEV_MODE"] == "1"  # /sleep and /wake_up are dev-mode endpoints
        assert "--weight-transfer-config" not in s.cmd and "VLLM_ALLOW_INSECURE_SERIALIZATION" not in s.env


def test_colocated_vllm_servers_taking_the_trainers_tensors_start_the_ipc_transfer_engine(tmp_path):
    sync = "rollout.weight_sync=tensor"
    cfg = _cfg("rollout.backend=vllm:d2t2", "actor.backend=archon:d4", "cluster.n_gpus_per_node=4", sync)
    for s in build_launch_specs(cfg, tmp_path, ports=[1, 2]):
        assert _flag(s.cmd, "--weight-transfer-config") == '{"backend": "ipc"}'
        assert s.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"  # /update_weights unpickles the handles


@pytest.mark.parametrize("device, visible, extra", [("cuda", ["0", "1"], ["--device", "cuda"]), ("cpu", ["", ""], [])])
def test_a_colocated_built_in_server_runs_on_its_ranks_gpu_when_training_does(tmp_path, device, visible, extra):
    cfg = _cfg("rollout.backend=local:d2", "actor.backend=archon:d2", "cluster.n_gpus_per_node=2", f"device={device}")
    specs = build_launch_specs(cfg, tmp_path, ports=[1, 2])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == visible
    assert all(s.cmd[s.cmd.index("--random-seed") + 2 :] == extra for s in specs)


def test_the_in_process_backend_launches_nothing(tmp_path):
    cfg = load_config(None, ["actor.path=/models/tiny", "rollout.backend=inprocess:d2", "actor.backend=archon:d2"])
    assert build_launch_specs(cfg, tmp_path) == []
    job = build_job(cfg, plan_for_config(cfg), None, [])
    assert len(job.steps) == 1 and job.prepare == [] and "ARCHON_SERVER_REGISTRY" not in job.env
    assert "torch.distributed.run" in job.steps[0].argv


def test_a_colocated_slurm_job_runs_servers_and_torchrun_on_the_same_gpus(tmp_path):
    overrides = [
        *COLOCATED,
        "rollout.backend=sglang:d4t2",
        "actor.backend=archon:d8",
        "cluster.n_nodes=2",
        "cluster.n_gpus_per_node=4",
        f"output_dir={tmp_path}",
    ]
    cfg = load_config(None, overrides)
    job = build_job(cfg, plan_for_config(cfg), None, overrides)
    serve, train = job.steps[:2], job.steps[2]
    assert [s.nodes for s in serve] == [(0,), (1,)] and train.nodes == (0, 1)
    assert serve[0].title == "node 0: rollout servers 0, 1 (GPUs 0,1 | 2,3), colocated with training ranks 0-3"
    assert serve[1].title.endswith("colocated with training ranks 4-7")
    assert train.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    srun = [line for line in render_script(job).splitlines() if line.startswith("srun ")]
    # Every step asks for the node's GPUs and overlaps the others: the servers share the torchrun step's GPUs.
    assert len(srun) == 3 and all("--overlap" in line and "--gpus-per-node=4" in line for line in srun)
    shown = dry_run_text(job, cfg)
    for i, gpus in enumerate(["0,1", "2,3", "0,1", "2,3"]):
        assert f"server {i} (log {tmp_path}/rollout/server_{i}.log): CUDA_VISIBLE_DEVICES={gpus} " in shown
    assert shown.count("--enable-memory-saver") == 4


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_make_run_colocates_the_demo_on_a_machine_with_one_gpu(tmp_path, gpus):
    smi = tmp_path / "bin" / "nvidia-smi"  # stands in for the driver's tool: `nvidia-smi -L` lists one line per GPU
    smi.parent.mkdir()
    smi.write_text(
        "#!/bin/sh\n" + "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})"\n' for i in range(gpus))
    )
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{smi.parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["make", "-n", "run"], cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    argv = shlex.split(next(line for line in out.splitlines() if "torch.distributed.run" in line))
    nproc = int(next(a for a in argv if a.startswith("--nproc_per_node=")).split("=")[1])
    overrides = argv[argv.index("--config") + 2 :]
    cfg = load_config(REPO / argv[argv.index("--config") + 1], overrides)
    plan = plan_for_config(cfg)
    assert plan.train_world_size == nproc
    if gpus == 1:
        assert cfg.device == "cuda" and plan.colocated and plan.used_gpus == plan.n_gpus_per_node == 1
        assert plan.servers[0].gpus == plan.rank(0).gpus == (0,)
    else:  # the CPU demo as written: 2 training processes and a server on 3 process slots
        assert overrides == [] and cfg.device == "cpu" and not plan.colocated and plan.used_gpus == 3
