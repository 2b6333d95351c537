"""What a launched server inherits: no torchrun variables, and GPUs mapped through an inherited CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from dist_utils import find_free_port

from archon.config import ConfigError, load_config
from archon.launch.servers import build_launch_specs, server_environment, visible_devices

# What a server's own torch.distributed does at start (SGLang's TP group, vLLM's workers): rank 0 of its
# own group, rendezvous over tcp://.  Under torchrun's environment the store becomes a client of a server
# that does not exist, and the call waits for it until its timeout.
SERVER_INIT = textwrap.dedent(
    """
    import datetime, sys
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=4))
    dist.destroy_process_group()
    print("joined")
    """
)


def _torchrun_rank_environment() -> dict[str, str]:
    """The variables torchrun's agent gives a training rank (torch/distributed/elastic/agent/server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        GROUP_RANK="0",
        ROLE_RANK="0",
        ROLE_NAME="default",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(find_free_port()),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="none",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    return env


def _server_init(env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", SERVER_INIT, str(find_free_port())]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_a_launched_servers_process_group_forms_without_torchruns_variables():
    rank_env = _torchrun_rank_environment()
    inherited = _server_init(rank_env)  # what {**os.environ, ...} gave a server launched by rank 0
    assert inherited.returncode != 0 and "joined" not in inherited.stdout
    clean = server_environment({"PYTHONUNBUFFERED": "1"}, base=rank_env)
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"} & set(clean)
    assert not [k for k in clean if k.startswith("TORCHELASTIC_")]
    assert clean["PYTHONUNBUFFERED"] == "1" and clean["PATH"] == rank_env["PATH"]
    launched = _server_init(clean)
    assert launched.returncode == 0 and "joined" in launched.stdout, launched.stderr


def test_plan_gpus_are_mapped_through_an_inherited_device_list():
    assert visible_devices([0, 1], "server 0", inherited="") == "0,1"
    assert visible_devices([2, 3], "server 1", inherited="4,5,6,7") == "6,7"
    assert visible_devices([1], "server 0", inherited="GPU-aa, GPU-bb") == "GPU-bb"
    with pytest.raises(ConfigError, match=r"sees only 2 \(CUDA_VISIBLE_DEVICES=4,5\).*n_gpus_per_node = 2"):
        visible_devices([1, 2], "rollout server 0", inherited="4,5")


def test_launched_servers_get_their_slice_of_a_partial_node(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "max_position_embeddings": 64}')
    cfg = load_config(
        None,
        [
            f"actor.path='{tmp_path}'",
            "rollout.backend=sglang:d2",
            "actor.backend=archon:d2",
            "cluster.n_gpus_per_node=4",
        ],
    )
    # Slurm gave this job GPUs 4-7 of the node; the plan numbers them 0-3 (servers on 0 and 1).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    specs = build_launch_specs(cfg, tmp_path / "run", ports=[1, 2])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["4", "5"]
    # A launcher that bound each server's devices itself (Ray's serve-node --gpus) keeps the plan's ids.
    specs = build_launch_specs(cfg, tmp_path / "run", ports=[1, 2], map_visible_devices=False)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1"]
    # The built-in server is a CPU process: it never takes a GPU, whatever is visible.
    local = load_config(None, [f"actor.path='{tmp_path}'", "rollout.backend=local:d2", "actor.backend=archon:d2"])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in build_launch_specs(local, tmp_path / "run", ports=[1, 2])] == [
        "",
        "",
    ]
