"""Launching on a cluster: published server addresses, the Slurm script, serve-node, bad input.

The Slurm job itself runs here as two simulated nodes: the generated script under bash, with
stand-ins for ``srun`` and ``scontrol`` (``slurm_fakes.py``) that run each step's command once
per listed host with the variables Slurm sets, and rendezvous on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import find_free_port, pid_alive
from launch_demo import DEMO, REPO, _demo_overrides, _env

from archon.config import load_config
from archon.launch.cli import main
from archon.launch.discovery import (
    LAUNCH_ID_ENV,
    REGISTRY_ENV,
    FileRegistry,
    PublishedServers,
    ServerRecord,
    registry_from_env,
    server_source,
)
from archon.launch.servers import RolloutLauncher, RolloutLaunchError
from archon.launch.slurm import build_job, check_torchrun_layout, render_script
from archon.plan import plan_for_config

DENSE = REPO / "configs" / "qwen3_8b_dense.toml"
MOE = REPO / "configs" / "qwen3_30b_a3b_moe.toml"


def _record(index: int, launch: str = "job-1", **kw) -> ServerRecord:
    return ServerRecord(
        index=index, node=0, host="n0", log_path=f"/run/rollout/server_{index}.log", launch_id=launch, **kw
    )


# ---------------------------------------------------------------------- published addresses
def test_file_registry_publishes_atomically_and_ignores_other_launches(tmp_path):
    folder = tmp_path / "servers"
    old = FileRegistry.prepare(folder, "job-0")
    old.publish(_record(0, "job-0", addr="a:1"))
    reg = FileRegistry.prepare(folder, "job-1")  # a new job in the same run directory
    assert reg.records() == {}  # the earlier job's record is gone
    (folder / "server_1.json").write_text('{"index": 1, "no')  # a torn write is never taken for a record
    reg.publish(_record(0, addr="h:5"))
    FileRegistry(folder, "job-0").publish(_record(2, "job-0", addr="stale:1"))
    assert {i: r.addr for i, r in reg.records().items()} == {0: "h:5"}
    assert not list(folder.glob(".*tmp"))
    reg.check()


def test_a_node_that_does_not_see_the_run_directory_is_one_sentence(tmp_path):
    with pytest.raises(Exception, match=r"missing on .*not on a filesystem that every node mounts") as info:
        FileRegistry(tmp_path / "nowhere", "job-1").check()
    assert "\n" not in str(info.value)
    FileRegistry.prepare(tmp_path / "s", "job-7")
    with pytest.raises(Exception, match="belongs to launch 'job-7', not to this one"):
        FileRegistry(tmp_path / "s", "job-8").check()


def test_trainer_waits_for_every_server_and_names_the_missing_ones(tmp_path):
    cfg = load_config(DEMO, ["rollout.backend=local:d3", "cluster.n_gpus_per_node=5", f"output_dir={tmp_path}"])
    servers = plan_for_config(cfg).servers
    reg = FileRegistry.prepare(tmp_path / "rollout" / "servers", "job-1")
    reg.publish(_record(1, addr="h:2"))
    reg.publish(_record(0, addr="h:1"))
    source = PublishedServers(reg, servers, tmp_path, "key", timeout=0.3, poll_s=0.05)
    with pytest.raises(RolloutLaunchError) as info:
        source.start()
    message = str(info.value)
    assert "server 2 on node 0" in message and str(tmp_path / "rollout" / "server_2.log") in message
    assert "server 0 on" not in message and "rollout.setup_timeout" in message
    reg.publish(_record(2, addr="h:3"))
    assert source.start() == ["h:1", "h:2", "h:3"]  # in server order, whatever the order of publishing
    assert source.specs == [] and source.api_key == "key"
    assert source.log_hint("http://h:3") == "its log is /run/rollout/server_2.log on n0"


def test_a_server_that_failed_to_start_stops_the_wait_at_once(tmp_path):
    cfg = load_config(DEMO, [f"output_dir={tmp_path}"])
    reg = FileRegistry.prepare(tmp_path / "servers", "job-1")
    reg.publish(_record(0, error="exited with code 1 during startup; last lines: CUDA out of memory"))
    start = time.monotonic()
    with pytest.raises(RolloutLaunchError, match="server 0 on node 0 .n0. failed to start.*CUDA out of memory"):
        PublishedServers(reg, plan_for_config(cfg).servers, tmp_path, "key", timeout=60).start()
    assert time.monotonic() - start < 30


def test_server_source_launches_waits_or_uses_the_given_addresses(tmp_path):
    cfg = load_config(DEMO, [f"output_dir={tmp_path}"])
    assert isinstance(server_source(cfg, env={}), RolloutLauncher)
    env = {REGISTRY_ENV: f"file:{tmp_path / 'rollout' / 'servers'}", LAUNCH_ID_ENV: "job-1", "ARCHON_API_KEY": "secret"}
    source = server_source(cfg, env=env)
    assert isinstance(source, PublishedServers) and source.api_key == "secret"
    assert [s.index for s in source.servers] == [0]
    given = load_config(DEMO, [f"output_dir={tmp_path}", 'rollout.server_addrs=["h:1"]'])
    launcher = server_source(given, env=env)
    assert isinstance(launcher, RolloutLauncher) and launcher.addrs == ["h:1"] and not launcher.specs
    with pytest.raises(Exception, match=f"{LAUNCH_ID_ENV} is not"):
        registry_from_env({REGISTRY_ENV: "file:/x"})
    with pytest.raises(Exception, match="neither 'file:<folder>' nor 'ray:<namespace>'"):
        registry_from_env({REGISTRY_ENV: "nfs:/x", LAUNCH_ID_ENV: "1"})
    env.pop("ARCHON_API_KEY")
    with pytest.raises(Exception, match="no API key for the rollout servers"):
        server_source(cfg, env=env)


# ---------------------------------------------------------------------- the Slurm script
def _job(config: Path, *overrides: str):
    cfg = load_config(config, list(overrides))
    return build_job(cfg, plan_for_config(cfg), str(config), list(overrides))


@pytest.mark.parametrize(
    "config,rollout_nodes,train_nodes,server_gpus",
    [
        (DENSE, [0], [1, 2], ["0,1", "2,3", "4,5", "6,7"]),
        (MOE, [0, 1], [2, 3], ["0,1,2,3", "4,5,6,7", "0,1,2,3", "4,5,6,7"]),
    ],
)
def test_recipe_scripts_follow_the_plan(config, rollout_nodes, train_nodes, server_gpus, tmp_path, capsys):
    job = _job(config)
    script = render_script(job)
    n_nodes = len(rollout_nodes) + len(train_nodes)
    assert f"#SBATCH --nodes={n_nodes}\n" in script and "#SBATCH --gpus-per-node=8\n" in script
    assert 'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in script
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == len(rollout_nodes) + 1
    for line, node in zip(srun, rollout_nodes):
        assert f'--nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist="${{NODES[{node}]}}"' in line
    hosts = ",".join(f"${{NODES[{n}]}}" for n in train_nodes)
    assert f'--nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist="{hosts}"' in srun[-1]
    serve = re.findall(r"archon.launch serve-node --node (\d+) --config (\S+)", script)
    assert [int(n) for n, _ in serve] == rollout_nodes and {c for _, c in serve} == {str(config)}
    train = script[script.index(srun[-1]) :]
    assert "env CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 " in train
    assert "--nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d" in train
    assert f'"--rdzv_endpoint=${{NODES[{train_nodes[0]}]}}:29500"' in train
    assert str(REPO / "scripts" / "train_rl.py") in train
    assert "archon.launch prepare --config" in script and 'export ARCHON_LAUNCH_ID="slurm-${SLURM_JOB_ID}"' in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0

    assert main(["slurm", "--config", str(config), "--dry-run"]) == 0
    shown = capsys.readouterr().out
    for i, gpus in enumerate(server_gpus):  # each server's own command and GPUs, on its node
        assert re.search(
            rf"server {i} \(log \S+server_{i}\.log\): CUDA_VISIBLE_DEVICES={gpus} \S+ -m "
            r"sglang\.launch_server .*--port <port> --tp-size",
            shown,
        ), shown
    for node in train_nodes:
        assert f"node {node} (${{NODES[{node}]}}): training ranks" in shown
    assert "<api key>" in shown


def test_one_node_job_runs_its_servers_and_training_side_by_side():
    job = _job(DENSE, "cluster.n_nodes=1", "rollout.backend=sglang:d2t2", "actor.backend=archon:d4")
    script = render_script(job)
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 2 and all('--nodelist="${NODES[0]}"' in line and "--overlap" in line for line in srun)
    train = script[script.index(srun[1]) :]
    assert "env CUDA_VISIBLE_DEVICES=4,5,6,7 " in train and "--nnodes=1 --nproc_per_node=4" in train


def test_submit_hands_the_written_script_to_sbatch(tmp_path, monkeypatch, capsys):
    args = [
        "slurm",
        "--config",
        str(DENSE),
        "--script",
        str(tmp_path / "job.sbatch"),
        "--submit",
        "--sbatch-arg=--partition=gpu",
        f"output_dir={tmp_path / 'run'}",
    ]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(args) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport sys\nopen({str(tmp_path / 'argv')!r}, 'w').write(sys.argv[1])\n"
        "print('Submitted batch job 31337')\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    assert main(args) == 0
    assert "Submitted batch job 31337" in capsys.readouterr().out
    assert (tmp_path / "argv").read_text() == str(tmp_path / "job.sbatch")
    script = (tmp_path / "job.sbatch").read_text()
    assert (
        "#SBATCH --partition=gpu\n" in script and f"#SBATCH --output={tmp_path / 'run'}/launch/slurm-%j.log" in script
    )


def test_training_nodes_with_different_gpus_are_refused_for_torchrun():
    # 2 nodes of 8: four 1-GPU servers and 12 ranks share node 0 (ranks on GPUs 4-7) and fill node 1.
    cfg = load_config(
        DEMO, ["cluster.n_nodes=2", "cluster.n_gpus_per_node=8", "rollout.backend=local:d4", "actor.backend=archon:d12"]
    )
    with pytest.raises(Exception, match=r"node 0: GPUs 4-7, node 1: GPUs 0-7.*launch with Ray") as info:
        check_torchrun_layout(plan_for_config(cfg))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["cluster.n_nodes=1", "cluster.n_gpus_per_node=2"], r"together 3, but cluster.n_nodes=1 x "),
        (["rollout.backend=sglang:d1t16", "cluster.n_gpus_per_node=8"], r"16 GPUs \(t\*p\), more than a node's"),
    ],
)
@pytest.mark.parametrize("launcher", ["slurm", "ray"])
def test_a_layout_that_does_not_fit_is_one_sentence(launcher, overrides, message, capsys):
    extra = ["--address", "127.0.0.1:1"] if launcher == "ray" else []
    assert main([launcher, "--config", str(DEMO), *extra, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and err.startswith("error: ") and "\n" not in err, err


def test_an_unreachable_ray_address_is_one_sentence(capsys):
    pytest.importorskip("ray")
    port = find_free_port()  # nothing listens there
    assert main(["ray", "--config", str(DEMO), "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in err and "ray start --head" in err
    assert "\n" not in err


def test_serve_node_without_the_shared_run_directory_is_one_sentence(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(REGISTRY_ENV, f"file:{tmp_path / 'run' / 'rollout' / 'servers'}")
    monkeypatch.setenv(LAUNCH_ID_ENV, "slurm-1")
    assert main(["serve-node", "--config", str(DEMO), "--node", "0", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "server folder" in err and "is missing on" in err and "shared path" in err and "\n" not in err
    monkeypatch.delenv(REGISTRY_ENV)
    assert main(["serve-node", "--config", str(DEMO), "--node", "0"]) == 2
    assert "ARCHON_SERVER_REGISTRY is unset" in capsys.readouterr().err


# ---------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def demo_assets(tmp_path_factory):
    from archon.demos.first_letter import make_assets

    return make_assets(tmp_path_factory.mktemp("demo") / "assets")


@pytest.mark.slow
def test_slurm_job_runs_the_demo_on_two_simulated_nodes(demo_assets, tmp_path):
    """The generated script, run as a job of two nodes: the server step on node 0, torchrun on node 1."""
    from slurm_fakes import install

    out = tmp_path / "run"
    overrides = ["cluster.n_nodes=2", "cluster.n_gpus_per_node=2", *_demo_overrides(demo_assets, out, 3)]
    script = tmp_path / "job.sbatch"
    port = find_free_port()
    assert main(["slurm", "--config", str(DEMO), "--script", str(script), "--rdzv-port", str(port), *overrides]) == 0
    bin_dir = install(tmp_path / "bin")
    srun_log = tmp_path / "srun.jsonl"
    env = _env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost,127.0.0.1",
        SLURM_NNODES="2",
        SLURM_CPUS_ON_NODE="2",
        FAKE_SRUN_LOG=str(srun_log),
    )
    done = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]

    # The server step runs in the background: the two steps may log in either order.
    steps = sorted(
        (json.loads(line) for line in srun_log.read_text().splitlines()), key=lambda s: "serve-node" not in s["command"]
    )
    assert [s["hosts"] for s in steps] == [["localhost"], ["127.0.0.1"]]
    assert steps[0]["command"][1:5] == ["-m", "archon.launch", "serve-node", "--node"]
    assert f"--rdzv_endpoint=127.0.0.1:{port}" in steps[1]["command"] and "--nproc_per_node=2" in steps[1]["command"]
    # The trainer found the server in the run directory and launched none itself.
    record = json.loads((out / "rollout" / "servers" / "server_0.json").read_text())
    assert record["launch_id"] == "slurm-4242" and record["addr"] and not record["error"]
    log = done.stdout + done.stderr
    assert f"rollout servers published: {record['addr']}" in log
    assert len(re.findall(r"started rollout server 0 \(pid (\d+)\)", log)) == 1  # by serve-node only
    assert stat.S_IMODE((out / "rollout" / "api_key").stat().st_mode) == 0o600
    started = re.search(r"started rollout server 0 \(pid (\d+)\)", log)
    assert started is not None
    server_pid = int(started.group(1))
    assert not pid_alive(server_pid)  # the script stopped the server step when training ended
    assert "node 0: stopping its rollout servers" in log  # with a SIGTERM serve-node handles, not srun's SIGKILL


@pytest.mark.slow
def test_serve_node_reports_a_server_that_dies_with_its_log(demo_assets, tmp_path):
    out = tmp_path / "run"
    env = _env(**{REGISTRY_ENV: f"file:{out / 'rollout' / 'servers'}", LAUNCH_ID_ENV: "slurm-7"})
    args = ["--config", str(DEMO), *_demo_overrides(demo_assets, out, 1)]
    assert subprocess.run([sys.executable, "-m", "archon.launch", "prepare", *args], env=env).returncode == 0
    log = tmp_path / "serve-node.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "archon.launch", "serve-node", "--node", "0", *args],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        registry = FileRegistry(out / "rollout" / "servers", "slurm-7")
        deadline = time.monotonic() + 180
        while not registry.records() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        record = registry.records()[0]
        assert record.addr and record.host and record.log_path == str(out / "rollout" / "server_0.log")
        started = re.search(r"started rollout server 0 \(pid (\d+)\)", log.read_text())
        assert started is not None
        server_pid = int(started.group(1))
        os.kill(server_pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    assert f"rollout server 0 on node 0 exited with code -9; last lines of {record.log_path}" in text
    assert "every rollout server of node 0 has exited" in text
