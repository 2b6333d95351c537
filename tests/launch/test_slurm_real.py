"""The Slurm launcher on a real one-node Slurm (``real_slurm.py``: Debian's slurm-wlm and munge).

The fakes of ``test_launch.py`` run the script under bash; here ``sbatch`` hands it to a real
slurmctld and slurmd, whose ``srun`` steps run the CPU demo, share the node's CPUs and GPUs
(declared as generic resources, so Slurm sets ``CUDA_VISIBLE_DEVICES`` itself) and are stopped
by ``scancel``.  Skipped, with the reason, where Slurm cannot be installed or started.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import find_free_port, pid_alive, pids_mentioning, wait_until
from launch_demo import DEMO, _demo_overrides, _env
from real_slurm import SlurmCluster, SlurmUnavailable, new_root, start_cluster

from archon.config import load_config
from archon.launch.slurm import build_job, log_path, render_script
from archon.plan import plan_for_config

pytestmark = pytest.mark.slow

GPUS = 4
"""GPUs the node declares as generic resources."""


@pytest.fixture(scope="session")
def slurm():
    try:
        cluster = start_cluster(new_root(), gpus=GPUS)
    except SlurmUnavailable as exc:
        pytest.skip(f"no real Slurm here: {exc}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def demo_assets(tmp_path_factory):
    from archon.demos.first_letter import make_assets

    return make_assets(tmp_path_factory.mktemp("demo") / "assets")


def _launch(slurm: SlurmCluster, *args: str) -> str:
    """``python -m archon.launch slurm --config cpu_demo.toml <args> --submit``; the job id."""
    cmd = [sys.executable, "-m", "archon.launch", "slurm", "--config", str(DEMO), "--submit", *args]
    done = subprocess.run(cmd, env=_env(**slurm.env), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    submitted = re.search(r"Submitted batch job (\d+)", done.stdout)
    assert submitted, done.stdout
    return submitted.group(1)


def _job_log(out: Path, job_id: str) -> str:
    log = out / "launch" / f"slurm-{job_id}.log"
    return log.read_text() if log.is_file() else f"(no job log {log})"


def _leftovers(*marks: str) -> list[int]:
    return sorted({pid for mark in marks for pid in pids_mentioning(mark)})


def test_real_slurm_runs_the_cpu_demo(slurm, demo_assets, tmp_path):
    """sbatch, the prepare command, a server step and a torchrun step, on a real Slurm, to COMPLETED."""
    out = tmp_path / "run"
    # The script outside the run directory: the job's log folder must exist before Slurm starts the job.
    script = tmp_path / "job.sbatch"
    job_id = _launch(
        slurm, "--script", str(script), "--rdzv-port", str(find_free_port()), *_demo_overrides(demo_assets, out, 3)
    )
    fields = slurm.wait_for_end(job_id)
    log = _job_log(out, job_id)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:] + slurm.log_tail()

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["reward_mean"]) and 0 <= r["reward_mean"] <= 1 for r in records)
    # The job's real id reached every step: the server published under it, the trainer found it there.
    record = json.loads((out / "rollout" / "servers" / "server_0.json").read_text())
    assert record["launch_id"] == f"slurm-{job_id}" and record["host"] == slurm.node and not record["error"]
    assert f"rollout servers published: {record['addr']}" in log
    # When training ended the script stopped the server step with SIGTERM, which serve-node handles
    # (stopping its servers itself), not with srun's SIGKILL.
    assert "node 0: stopping its rollout servers" in log and "Killed" not in log, log[-3000:]
    started = re.search(r"started rollout server 0 \(pid (\d+)\)", log)
    assert started is not None
    assert not pid_alive(int(started.group(1)))
    assert not _leftovers(str(out), str(demo_assets.model))


# Records the variables a step sees (and, in the server step, the CUDA_VISIBLE_DEVICES each server
# would get from serve-node), then waits for the other step's record: with steps that could not
# share the GPUs the second would never start, and the wait would time out.
_RECORD = """
import json, os, sys, time
out, other, role, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
keys = ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE",
        "SLURM_STEP_ID", "SLURM_CPUS_ON_NODE", "SLURMD_NODENAME")
rec = {k: os.environ.get(k) for k in keys}
if role == "servers":
    from archon.config import load_config
    from archon.launch.servers import build_launch_specs
    cfg = load_config(args[1], args[2:])
    specs = build_launch_specs(cfg, cfg.run_dir, node=0, api_key="k")
    rec["servers"] = {s.index: s.env.get("CUDA_VISIBLE_DEVICES") for s in specs}
with open(out + ".tmp", "w") as fh:
    json.dump(rec, fh)
os.replace(out + ".tmp", out)
deadline = time.monotonic() + 120
while other != "-" and not os.path.exists(other):
    assert time.monotonic() < deadline, f"{other} never appeared: the steps did not run side by side"
    time.sleep(0.05)
"""


def _recording_job(tmp_path: Path, overrides: list[str]):
    """Archon's job for ``overrides`` (GPUs asked as the launcher asks), each command swapped for ``_RECORD``."""
    cfg = load_config(DEMO, overrides)
    job = build_job(cfg, plan_for_config(cfg), str(DEMO), overrides)
    assert job.gpus and [len(s.nodes) for s in job.steps] == [1, 1]
    server, train = job.steps
    args = ["--config", str(DEMO), *overrides]
    py = sys.executable
    job.prepare = [py, "-c", _RECORD, str(tmp_path / "batch.json"), "-", "batch"]
    server.argv = [py, "-c", _RECORD, str(tmp_path / "servers.json"), str(tmp_path / "train.json"), "servers", *args]
    train.argv = [py, "-c", _RECORD, str(tmp_path / "train.json"), str(tmp_path / "servers.json"), "train"]
    return job, server, train


@pytest.mark.parametrize(
    "n_gpus,rollout,actor,server_gpus,train_gpus",
    [
        (4, "sglang:d2", "archon:d2", {"0": "0", "1": "1"}, "2,3"),  # the whole node
        (2, "sglang:d1", "archon:d1", {"0": "0"}, "1"),  # 2 of the node's 4 GPUs
    ],
)
def test_real_slurm_sets_cuda_visible_devices_in_each_step(
    slurm, tmp_path, n_gpus, rollout, actor, server_gpus, train_gpus
):
    """Archon's GPU request (--gpus-per-node on the job and on each --overlap step) on GPUs Slurm manages."""
    overrides = [
        "device=cuda",
        f"cluster.n_gpus_per_node={n_gpus}",
        f"rollout.backend={rollout}",
        f"actor.backend={actor}",
        f"output_dir={tmp_path / 'run'}",
    ]
    job, server, train = _recording_job(tmp_path, overrides)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(job))
    log_path(job).parent.mkdir(parents=True)
    done = slurm.run("sbatch", "--parsable", str(script))
    job_id = done.stdout.strip().split(";")[0]
    fields = slurm.wait_for_end(job_id, timeout=180)
    log = _job_log(tmp_path / "run", job_id)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:] + slurm.log_tail()

    seen = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("batch", "servers", "train")}
    print(json.dumps(seen, indent=1))  # what Slurm set, for the record (pytest -s)
    # --exclusive gives the job every GPU of the node, whatever --gpus-per-node asked.
    assert seen["batch"]["CUDA_VISIBLE_DEVICES"] == seen["batch"]["SLURM_JOB_GPUS"] == ",".join(map(str, range(GPUS)))
    # Each step asks for cluster.n_gpus_per_node GPUs and gets the first ones, both steps the same, side by side.
    step_gpus = ",".join(map(str, range(n_gpus)))
    assert seen["servers"]["CUDA_VISIBLE_DEVICES"] == step_gpus
    assert seen["servers"]["SLURM_STEP_GPUS"] == seen["train"]["SLURM_STEP_GPUS"] == step_gpus
    assert seen["servers"]["SLURM_STEP_ID"] != seen["train"]["SLURM_STEP_ID"]
    # serve-node gives each server its plan GPUs, which are Slurm's numbers here.
    assert seen["servers"]["servers"] == server_gpus
    # The training step's `env CUDA_VISIBLE_DEVICES=<plan GPUs>` replaces what Slurm set.
    assert seen["train"]["CUDA_VISIBLE_DEVICES"] == train_gpus
    assert train.env == {"CUDA_VISIBLE_DEVICES": train_gpus} and not server.env


@pytest.mark.parametrize(
    "scancel,end_state,graceful",
    [
        # Slurm sends SIGTERM to every step and the script; the srun clients, signalled too, may kill
        # (SIGKILL) their tasks before those have handled the SIGTERM.
        ([], "CANCELLED", False),
        # The script alone (exit code 143): its trap stops the steps, with a SIGTERM their tasks handle.
        (["--batch", "--signal=TERM"], "FAILED", True),
    ],
)
def test_a_cancelled_real_slurm_job_leaves_no_process(slurm, demo_assets, tmp_path, scancel, end_state, graceful):
    """scancel mid-training: Slurm reports the job ended and no process of it is left on the node."""
    out = tmp_path / "run"
    job_id = _launch(slurm, "--rdzv-port", str(find_free_port()), *_demo_overrides(demo_assets, out, 300))
    metrics = out / "metrics.jsonl"

    def training() -> bool:
        if slurm.job_fields(job_id)["JobState"] not in ("PENDING", "RUNNING"):
            raise AssertionError(f"job {job_id} ended before training began: {_job_log(out, job_id)[-3000:]}")
        return metrics.is_file() and bool(metrics.read_text())

    wait_until(training, "the first training step", timeout=300, poll_s=0.2)
    log = _job_log(out, job_id)
    started = re.search(r"started rollout server 0 \(pid (\d+)\)", log)
    assert started is not None, log[-3000:]
    slurm.run("scancel", *scancel, job_id)
    fields = slurm.wait_for_end(job_id, timeout=120)
    assert fields["JobState"] == end_state, _job_log(out, job_id)[-3000:]
    # Slurm has cleaned up the job's steps; a process that left their process groups and was not
    # stopped by Archon (a server, a training rank) would be running still.
    left = _leftovers(str(out), str(demo_assets.model))
    assert not left and not pid_alive(int(started.group(1))), [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
    assert len(metrics.read_text().splitlines()) < 300
    if graceful:
        log = _job_log(out, job_id)
        assert "node 0: stopping its rollout servers" in log and "Killed" not in log, log[-3000:]
