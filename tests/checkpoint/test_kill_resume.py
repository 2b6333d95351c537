"""Kill-and-resume drills on the CPU demo, and training ranks that outlive their launcher.

A drill runs ``scripts/train_rl.py --config configs/cpu_demo.toml`` (tiny step counts) under
torchrun and SIGKILLs the launcher's whole process group, as an impatient user, a scheduler or
the OOM killer would, then reruns the same command.  The kill lands in a chosen phase (rollout
requests in flight, between gradients and the optimizer step, mid weight broadcast, mid
checkpoint) through the test-only ``ARCHON_DRILL_PAUSE`` hook (``archon/runtime/drill.py``: the process
stops there and tells the test), or at a random moment.  After every kill no trainer rank and
no rollout server may be left; every rerun resumes from a complete checkpoint, never a
half-written one; and the run that finishes has per-step metrics equal to an uninterrupted run
of the same layout.  torchrun puts each worker in a session of its own, so killing the
launcher's group reaches the workers only through their parent-death signal.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dist_utils import pid_alive, pids_mentioning, wait_until
from paths import REPO, helpers_pythonpath

from archon.runtime.drill import FILE_ENV, PAUSE_ENV

CONFIG = REPO / "configs" / "cpu_demo.toml"
STEPS = 4
COMPARED = ("actor/loss", "reward_mean", "response_len_mean", "actor/grad_norm", "actor/entropy")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": helpers_pythonpath(), **extra}


# ---------------------------------------------------------------------------------- launcher death

_RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from archon.engine.dist import init_distributed
    init_distributed("cpu")
    Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    while True:  # a rank busy with anything but a collective
        time.sleep(3600)
""")


@pytest.mark.slow
def test_training_ranks_exit_when_the_launcher_is_killed(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",  # torchrun binds a free port itself: no window for another process to take it
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, env=_env(), cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    pid_files = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
    try:
        wait_until(lambda: all(p.is_file() for p in pid_files) or proc.poll() is not None, "both ranks to start")
        assert proc.poll() is None, "torchrun exited before its ranks started"
        ranks = [int(p.read_text()) for p in pid_files]
        assert all(pid_alive(r) for r in ranks)
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's group: the ranks sit in sessions of their own
        proc.wait()
        t0 = time.monotonic()
        wait_until(lambda: not any(pid_alive(r) for r in ranks), "the ranks to exit after their launcher died")
        print(f"ranks exited {time.monotonic() - t0:.2f} s after torchrun was killed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------------------------- RL drills


@pytest.fixture(scope="module")
def demo_assets(tmp_path_factory):
    from archon.demos.first_letter import DemoTask, TinyQwen3, make_assets

    # Untied embeddings: pipeline parallel puts the embeddings and the LM head on different stages.
    return make_assets(
        tmp_path_factory.mktemp("drill") / "assets",
        DemoTask(n_train=64, n_test=8, n_sft=8),
        TinyQwen3(tie_word_embeddings=False),
    )


def _overrides(assets, out: Path, backend: str) -> list[str]:
    return [
        f"actor.path={assets.model}",
        f"train_dataset.path={assets.train}",
        f"output_dir={out}",
        f"actor.backend={backend}",
        "actor.archon.pp_schedule=1F1B",
        f"total_train_steps={STEPS}",
        "saver.freq_steps=1",
        "saver.export_hf=false",
        "train_dataset.batch_size=4",
        "reward.n_workers=0",
        # Several buckets per weight sync, so a kill can land between two of them.
        "rollout.weight_chunk_mb=1",
    ]


class Drill:
    """Reruns of one command (``script args``, writing to ``out``), each killed (or not) as the test says."""

    def __init__(self, root: Path, out: Path, script: str, args: list[str], seed: int = 0):
        self.out = out
        self.root = root
        self.cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            str(REPO / "scripts" / script),
            *args,
        ]
        self.rng = random.Random(seed)
        self.launches = 0

    def _start(self, pause: str | None) -> tuple[subprocess.Popen, Path]:
        self.launches += 1
        log = self.root / f"launch_{self.launches}.log"
        marker = self.root / "drill.json"
        marker.unlink(missing_ok=True)
        env = _env(**({PAUSE_ENV: pause, FILE_ENV: str(marker)} if pause else {}))
        cmd = self.cmd[:4] + ["--standalone"] + self.cmd[4:]  # torchrun binds a free port itself
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True, stdout=fh, stderr=subprocess.STDOUT)
        return proc, log

    def _kill(self, proc: subprocess.Popen, log: Path) -> None:
        """SIGKILL the launcher's process group; then nothing of the run may be left."""
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        servers = [int(p) for p in re.findall(r"started rollout server \d+ \(pid (\d+)\)", log.read_text())]
        wait_until(
            lambda: not pids_mentioning(str(self.out)) and not any(pid_alive(p) for p in servers),
            f"every trainer rank and rollout server of launch {self.launches} to exit",
        )

    def kill_at(self, phase: str, n: int) -> str:
        """Run until a process reaches ``phase`` for the n-th time, kill there; returns the launch's log."""
        proc, log = self._start(f"{phase}:{n}")
        marker = self.root / "drill.json"
        wait_until(lambda: marker.is_file() or proc.poll() is not None, f"the run to reach {phase} #{n}", timeout=600)
        assert marker.is_file(), (
            f"launch {self.launches} ended (code {proc.poll()}) before {phase} #{n}:\n{log.read_text()[-3000:]}"
        )
        assert json.loads(marker.read_text())["phase"] == phase
        self._kill(proc, log)
        return log.read_text()

    def kill_at_random(self, after_step: int, resume_from: int) -> str:
        """Once this launch has finished ``after_step``, kill it at a random moment of what follows.

        A pause at its last checkpoint keeps the run from finishing first, so the kill always interrupts it.
        """
        proc, log = self._start(f"checkpoint:{STEPS - resume_from}")
        done = re.compile(rf"^step {after_step}/{STEPS}\b", re.MULTILINE)  # printed by this launch's rank 0
        wait_until(
            lambda: done.search(log.read_text()) is not None or proc.poll() is not None,
            f"launch {self.launches} to finish step {after_step}",
            timeout=600,
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(self.rng.uniform(0.0, 1.0))  # not a wait for a state: this picks the moment of the kill
        self._kill(proc, log)
        return log.read_text()

    def finish(self) -> str:
        proc, log = self._start(None)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        return log.read_text()

    def complete_checkpoints(self) -> list[int]:
        root = self.out / "checkpoints"
        return (
            sorted(
                int(p.name.split("_")[1]) for p in root.glob("step_*") if p.is_dir() and (p / "complete.json").is_file()
            )
            if root.is_dir()
            else []
        )


def _resumed_from(log: str) -> int | None:
    m = re.search(r"resumed from \S+/step_(\d+) at (?:RL )?step (\d+)", log)
    if m is None:
        return None
    assert m.group(1) == m.group(2)
    return int(m.group(1))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _uninterrupted(root: Path, script: str, args_for: Callable[[Path], list[str]]) -> list[dict]:
    """Per-step metrics of the same command run once without a kill.

    Launched exactly as the drill's runs are (torchrun, one thread per rank): Adam turns a gradient
    entry that is float noise into a full-size step, so a reference computed with other thread
    counts or reduction orders drifts by ~1e-3 in the grad norm within two steps.
    """
    root.mkdir()
    out = root / "run"
    Drill(root, out, script, args_for(out)).finish()
    return _metrics(out)


def _assert_same_metrics(
    drill: Drill, reference: list[dict], keys: tuple[str, ...] = COMPARED, rel: float | None = None
) -> None:
    records = _metrics(drill.out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in keys:
        assert [r[key] for r in records] == pytest.approx([r[key] for r in reference], abs=1e-6, rel=rel), key


@pytest.mark.slow
def test_rl_run_killed_anywhere_resumes_to_the_uninterrupted_metrics(demo_assets, tmp_path):
    # Two pipeline stages, each saving its own shards; each launch is killed at another place and resumes from the
    # newest complete checkpoint (the agent drill kills mid-rollout). The third launch's first weight sync (of the
    # resumed weights) has two 1 MiB buckets: the kill lands between them.
    backend = "archon:p2"
    plan = [("checkpoint", 2), ("optimizer_step", 2), ("weight_sync", 2), ("random", 3)]

    def args_for(out: Path) -> list[str]:
        return ["--config", str(CONFIG), *_overrides(demo_assets, out, backend)]

    reference = _uninterrupted(tmp_path / "reference", "train_rl.py", args_for)
    out = tmp_path / "run"
    drill = Drill(tmp_path, out, "train_rl.py", args_for(out), seed=len(backend) + len(plan))
    for phase, n in plan:
        before = drill.complete_checkpoints()
        log = drill.kill_at_random(n, before[-1]) if phase == "random" else drill.kill_at(phase, n)
        # Each launch resumed from the newest checkpoint complete when it started (or from scratch).
        assert _resumed_from(log) == (before[-1] if before else None), (phase, before, log[-2000:])
        if phase == "checkpoint":
            # Killed mid-write: a half-written folder that no rerun may load.
            partial = [p.name for p in (drill.out / "checkpoints").glob("*.partial")]
            assert partial, "the checkpoint drill did not leave a half-written checkpoint"
    before = drill.complete_checkpoints()
    log = drill.finish()
    assert _resumed_from(log) == before[-1]
    _assert_same_metrics(drill, reference)
    assert not list((drill.out / "checkpoints").glob("*.partial"))


@pytest.mark.slow
def test_agent_run_killed_with_episodes_in_flight_resumes_to_the_uninterrupted_metrics(tmp_path):
    """The agent demo (two-turn episodes through the recording proxy) killed while a step's episodes are in flight:
    the rerun regenerates that step's episodes from its checkpoint, none counted twice, and ends where an
    uninterrupted run ends."""
    from archon.demos.calculator_agent import CalculatorTask, make_assets

    assets = make_assets(tmp_path / "assets", CalculatorTask(n_train=64, n_test=8))

    def args_for(out: Path) -> list[str]:
        return [
            "--config",
            str(REPO / "configs" / "cpu_demo_agent.toml"),
            *_overrides(assets, out, "archon:d2"),
            "gconfig.n_samples=4",
            "cluster.n_gpus_per_node=3",  # 2 training ranks + 1 server
            "cluster.pin_cpu_cores=false",
        ]

    reference = _uninterrupted(tmp_path / "reference", "train_rl.py", args_for)
    out = tmp_path / "run"
    drill = Drill(tmp_path, out, "train_rl.py", args_for(out))
    log = drill.kill_at("rollout", 3)  # step 3's episodes running; steps 1 and 2 checkpointed
    assert _resumed_from(log) is None
    log = drill.finish()
    assert _resumed_from(log) == 2
    # The same ids and rewards; the server batches the episodes' requests as they happen to arrive, so behaviour
    # logprobs (in the loss's ratio) differ by float rounding between launches (grad norm 313.5897 vs 313.5896).
    _assert_same_metrics(drill, reference, ("reward_mean", "response_len_mean", "agent/call_right"))
    _assert_same_metrics(drill, reference, ("actor/loss", "actor/grad_norm", "actor/entropy"), rel=1e-5)


# ---------------------------------------------------------------------------------- SFT drill


def _sft_overrides(assets, out: Path) -> list[str]:
    return [
        f"actor.path={assets.model}",
        "actor.backend=archon:d2",
        "actor.dtype=float32",
        "actor.archon.enable_compile=false",
        f"train_dataset.path={assets.sft}",
        "train_dataset.batch_size=8",
        f"total_train_steps={STEPS}",
        "saver.freq_steps=1",
        "saver.export_hf=false",
        f"output_dir={out}",
        "cluster.n_gpus_per_node=4",
    ]


@pytest.mark.slow
def test_sft_run_killed_mid_checkpoint_resumes_to_the_uninterrupted_metrics(demo_assets, tmp_path):
    """SFT shares the checkpoints (and the optimizer-step drill point) with RL; one kill mid-checkpoint."""
    reference = _uninterrupted(tmp_path / "reference", "train_sft.py", lambda out: _sft_overrides(demo_assets, out))
    out = tmp_path / "run"
    drill = Drill(tmp_path, out, "train_sft.py", _sft_overrides(demo_assets, out))
    log = drill.kill_at("checkpoint", 3)  # steps 1 and 2 checkpointed, step 3's half-written
    assert _resumed_from(log) is None and drill.complete_checkpoints() == [1, 2]
    assert [p.name for p in (out / "checkpoints").glob("*.partial")] == ["step_3.partial"]
    log = drill.finish()
    assert _resumed_from(log) == 2
    _assert_same_metrics(drill, reference, ("loss", "grad_norm", "lr", "tokens"))
