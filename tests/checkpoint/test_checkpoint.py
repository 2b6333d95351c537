"""Checkpoints of a run: complete or ignored, damaged ones skipped for the previous one, disk full
mid-write leaves nothing half-written, and the checks made before training starts.

Every scenario runs ``CheckpointManager`` on a real sharded engine (``archon:d2``, two forked
gloo ranks) and compares the resumed engine with an uninterrupted one: the loss of the next
step after resuming from step N must equal the uninterrupted run's step N+1 loss.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path

import pytest
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf

STEPS = 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("ckpt_model")
    save_tiny_hf(folder, "qwen3", seed=5)
    return str(folder)


def _engine(path: str, backend: str = "archon:d2"):
    from archon.engine.engine import ArchonEngine

    return ArchonEngine(engine_config(path, backend), total_steps=STEPS + 1).initialize()


def _step(engine, step: int) -> float:
    return engine.train_batch(make_batch(step), sft_loss, sft_weight)["loss"]


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("archon.checkpoint").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train_and_save(path: str, run_dir: str, keep_last: int = 2) -> list[float]:
    """Steps 1..STEPS+1 uninterrupted; checkpoints after steps 1..STEPS (step STEPS+1 is the reference)."""
    from archon.checkpoint.manager import CheckpointManager

    engine = _engine(path)
    ckpt = CheckpointManager(run_dir, keep_last)
    losses = []
    for step in range(1, STEPS + 2):
        losses.append(_step(engine, step))
        if step <= STEPS:
            ckpt.save(step, {"actor": engine}, {"at": step})
    return losses


def _resume(path: str, run_dir: str) -> dict | None:
    """Resume like a rerun does; rank 0 reports where from, the warnings, and the next step's loss."""
    import torch.distributed as dist

    from archon.checkpoint.manager import CheckpointManager

    warnings = _Warnings()
    engine = _engine(path)
    ckpt = CheckpointManager(run_dir, keep_last=2)
    extra = ckpt.load({"actor": engine})
    out = {
        "extra": extra,
        "step": engine.step,
        "loaded": ckpt.loaded.name if ckpt.loaded else None,
        "warnings": warnings.messages,
    }
    if extra is not None:
        out["next_loss"] = _step(engine, engine.step + 1)
        # The rerun goes on and checkpoints again: the intact older folder must survive that.
        ckpt.save(engine.step, {"actor": engine}, extra)
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def saved_run(model_path, tmp_path_factory):
    """One uninterrupted run's losses and its checkpoint folder (copied by each test before damaging it)."""
    run_dir = tmp_path_factory.mktemp("ckpt_run")
    losses = run_distributed(_train_and_save, 2, model_path, str(run_dir), timeout=300)[0]
    return losses, run_dir


def _copy_run(saved_run, tmp_path: Path) -> tuple[list[float], Path]:
    losses, run_dir = saved_run
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return losses, target


def test_saves_are_complete_and_pruned_only_after_the_new_one(saved_run):
    _, run_dir = saved_run
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", f"step_{STEPS - 1}", f"step_{STEPS}"]
    assert (root / "latest").read_text() == f"step_{STEPS}"
    for step in (STEPS - 1, STEPS):
        marker = json.loads((root / f"step_{step}" / "complete.json").read_text())
        assert marker["step"] == step
        files = marker["files"]
        # Every file of the checkpoint is listed with its size: both ranks' shards, the DCP index, the state.
        assert {
            "actor/dcp/__0_0.distcp",
            "actor/dcp/__1_0.distcp",
            "actor/dcp/.metadata",
            "actor/engine_state.json",
            "actor/rng_state.safetensors",
        } <= set(files)
        for name, size in files.items():
            assert (root / f"step_{step}" / name).stat().st_size == size


def test_resume_from_the_newest_checkpoint_repeats_the_uninterrupted_run(model_path, saved_run, tmp_path):
    losses, run_dir = _copy_run(saved_run, tmp_path)
    out = run_distributed(_resume, 2, model_path, str(run_dir), timeout=300)[0]
    assert out["loaded"] == f"step_{STEPS}" and out["step"] == STEPS and out["extra"] == {"at": STEPS}
    assert out["warnings"] == []
    assert out["next_loss"] == pytest.approx(losses[STEPS], abs=1e-6)


def _damage_newest(run_dir: Path, how: str) -> str:
    newest = run_dir / "checkpoints" / f"step_{STEPS}"
    shard = newest / "actor" / "dcp" / "__1_0.distcp"
    if how == "delete_folder":
        shutil.rmtree(newest)  # what a user does by hand; `latest` still names it
    elif how == "delete_shard":
        shard.unlink()
    elif how == "truncate_shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    elif how == "no_marker":  # killed after the shards, before the marker (and the rename)
        (newest / "complete.json").unlink()
    elif how == "garbage_shard":  # same size, unreadable: only the read itself can tell
        shard.write_bytes(b"\x00" * shard.stat().st_size)
    elif how == "garbage_state":
        path = newest / "actor" / "engine_state.json"
        path.write_text("{" + "x" * (path.stat().st_size - 1))
    return newest.name


@pytest.mark.parametrize(
    "how", ["delete_folder", "delete_shard", "truncate_shard", "no_marker", "garbage_shard", "garbage_state"]
)
def test_damaged_newest_checkpoint_is_skipped_for_the_previous_one(model_path, saved_run, tmp_path, how):
    losses, run_dir = _copy_run(saved_run, tmp_path)
    damaged = _damage_newest(run_dir, how)
    out = run_distributed(_resume, 2, model_path, str(run_dir), timeout=300)[0]
    previous = STEPS - 1
    assert out["loaded"] == f"step_{previous}" and out["step"] == previous and out["extra"] == {"at": previous}
    assert out["next_loss"] == pytest.approx(losses[previous], abs=1e-6)  # exactly the uninterrupted step
    if how != "delete_folder":
        assert any(damaged in w for w in out["warnings"]), out["warnings"]  # the warning names it
    # The rerun's next checkpoint (step STEPS again) replaced the damaged one and kept the intact older one.
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", f"step_{previous}", f"step_{STEPS}"]
    assert (root / "latest").read_text() == f"step_{STEPS}"
    assert all((root / f"step_{s}" / "complete.json").is_file() for s in (previous, STEPS))


def test_every_checkpoint_damaged_is_an_error_naming_it(model_path, saved_run, tmp_path):
    _, run_dir = _copy_run(saved_run, tmp_path)
    for step in (STEPS - 1, STEPS):
        shard = run_dir / "checkpoints" / f"step_{step}" / "actor" / "dcp" / "__0_0.distcp"
        shard.write_bytes(b"\x00" * shard.stat().st_size)
    with pytest.raises(Exception, match=rf"no checkpoint under .*could be loaded.*step_{STEPS}"):
        run_distributed(_resume, 2, model_path, str(run_dir), timeout=300)


def test_no_complete_checkpoint_starts_from_scratch(model_path, saved_run, tmp_path):
    _, run_dir = _copy_run(saved_run, tmp_path)
    for step in (STEPS - 1, STEPS):
        (run_dir / "checkpoints" / f"step_{step}" / "complete.json").unlink()
    out = run_distributed(_resume, 2, model_path, str(run_dir), timeout=300)[0]
    assert out["extra"] is None and out["step"] == 0 and len(out["warnings"]) == 2


# ---- disk full mid-write ------------------------------------------------------------------------


def _disk_full_during_save(path: str, run_dir: str, where: str) -> dict:
    """Save steps 1 and 2, then step 3 with the disk filling up on one rank; resume afterwards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import archon.checkpoint.dcp as checkpoint
    from archon.checkpoint.dcp import CheckpointWriteError
    from archon.checkpoint.manager import CheckpointManager

    engine = _engine(path)
    ckpt = CheckpointManager(run_dir, keep_last=2)
    for step in (1, 2):
        _step(engine, step)
        ckpt.save(step, {"actor": engine}, {"at": step})
    _step(engine, 3)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "shards" and dist.get_rank() == 1:
        original = dcp_fs._write_item

        def write_half_then_fail(transforms, stream, data, *args, **kwargs):
            stream.write(b"\x01" * 64)  # some bytes reach the file before the disk is full
            no_space()

        dcp_fs._write_item = write_half_then_fail
    elif where == "engine_state" and dist.get_rank() == 0:
        original = checkpoint.save_file
        checkpoint.save_file = no_space
    try:
        ckpt.save(3, {"actor": engine}, {"at": 3})
        error = "no error"
    except CheckpointWriteError as exc:
        error = str(exc)
    if where == "shards" and dist.get_rank() == 1:
        dcp_fs._write_item = original
    elif where == "engine_state" and dist.get_rank() == 0:
        checkpoint.save_file = original
    dist.barrier()
    listing = sorted(p.name for p in Path(run_dir, "checkpoints").iterdir())
    resumed = _engine(path)
    extra = CheckpointManager(run_dir).load({"actor": resumed})
    return {"error": error, "listing": listing, "extra": extra, "step": resumed.step}


@pytest.mark.parametrize("where", ["shards", "engine_state"])
def test_disk_full_mid_save_leaves_the_previous_checkpoint(model_path, tmp_path, where):
    results = run_distributed(_disk_full_during_save, 2, model_path, str(tmp_path), where, timeout=300)
    for rank, out in enumerate(results):
        # Every rank stops with the same clear error (none is left waiting in a collective).
        assert "writing checkpoint" in out["error"] and "step_3 failed" in out["error"], (rank, out["error"])
        assert "No space left on device" in out["error"] or rank != 0, out["error"]
        assert "step_2 is intact" in out["error"] and "free disk space" in out["error"]
        # Nothing half-written remains; the previous checkpoint is what a rerun resumes from.
        assert out["listing"] == ["latest", "step_1", "step_2"], out["listing"]
        assert out["extra"] == {"at": 2} and out["step"] == 2


# ---- before training ------------------------------------------------------------------------------


def _preflight(path: str, run_dir: str, free_bytes: int | None) -> str:
    import shutil as shutil_module

    from archon.checkpoint.manager import CheckpointManager, estimate_checkpoint_bytes
    from archon.config import ConfigError

    ckpt = CheckpointManager(run_dir)
    try:
        ckpt.check_writable()
        engine = _engine(path, "archon:d1")
        needed = estimate_checkpoint_bytes({"actor": engine})
        assert engine.model is not None
        params = sum(p.numel() for p in engine.model.parameters())
        assert needed == 3 * 4 * params  # float32 parameters and AdamW's two moments
        if free_bytes is not None:
            real = shutil_module.disk_usage
            shutil_module.disk_usage = lambda p: real(p)._replace(free=free_bytes)
        ckpt.check_space({"actor": engine})
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_unwritable_output_dir_is_a_clear_error_before_training(model_path, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    msg = run_distributed(_preflight, 1, model_path, str(blocker / "run"), None, timeout=300)[0]
    assert msg.startswith(f"output_dir {blocker / 'run'} cannot be written") and "set output_dir" in msg, msg


def test_too_little_disk_space_is_a_clear_error_before_training(model_path, tmp_path):
    msg = run_distributed(_preflight, 1, model_path, str(tmp_path / "run"), 1000, timeout=300)[0]
    assert "has 0.00 GiB free, but one checkpoint of this run takes about" in msg and "actor" in msg, msg
    assert run_distributed(_preflight, 1, model_path, str(tmp_path / "run"), None, timeout=300)[0] == "no error"


def test_resumed_metrics_drop_redone_steps_and_a_line_cut_by_a_kill(tmp_path):
    from archon.metrics import MetricsLogger

    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')  # killed mid-write
    MetricsLogger(tmp_path, total_steps=6, start_step=2).close()
    assert (tmp_path / "metrics.jsonl").read_text() == lines[0] + "\n" + lines[1] + "\n"


def _pipelined(path: str, run_dir: str, phase: str) -> list[float] | None:
    """Under archon:p2 each rank's optimizer holds its own stage's parameters: save on one, resume on the other."""
    import torch.distributed as dist

    from archon.checkpoint.manager import CheckpointManager
    from archon.config import ArchonEngineConfig
    from archon.engine.engine import ArchonEngine

    cfg = engine_config(path, "archon:p2", archon={"pp_schedule": "1F1B"})
    assert isinstance(cfg.archon, ArchonEngineConfig)
    engine = ArchonEngine(cfg, total_steps=STEPS + 1).initialize()
    ckpt = CheckpointManager(run_dir)
    if phase == "first":
        losses = [_step(engine, s) for s in (1, 2)]
        ckpt.save(2, {"actor": engine}, {"at": 2})
    elif phase == "second":
        assert ckpt.load({"actor": engine}) == {"at": 2} and engine.step == 2
        losses = [_step(engine, s) for s in (3, 4)]
    else:
        losses = [_step(engine, s) for s in (1, 2, 3, 4)]
    return losses if dist.get_rank() == 0 else None


def test_resume_under_pipeline_parallel_repeats_the_uninterrupted_run(model_path, tmp_path):
    full = run_distributed(_pipelined, 2, model_path, str(tmp_path / "full"), "full", timeout=300)[0]
    first = run_distributed(_pipelined, 2, model_path, str(tmp_path / "run"), "first", timeout=300)[0]
    second = run_distributed(_pipelined, 2, model_path, str(tmp_path / "run"), "second", timeout=300)[0]
    assert first + second == pytest.approx(full, abs=1e-6)


def _run_job(kind: str, out: str) -> str:
    from archon.config import ConfigError, load_config

    # Nothing else is read before the check: the model and data paths need not exist.
    cfg = load_config(
        None,
        [
            "actor.path=/nonexistent/model",
            "train_dataset.path=/nonexistent/data.jsonl",
            f"output_dir={out}",
            "cluster.n_gpus_per_node=8",
            "actor.backend=archon:d1",
            "gconfig.n_samples=2",
        ],
    )
    try:
        if kind == "rl":
            from archon.rl.trainer import RLTrainer

            RLTrainer(cfg).run()
        else:
            from archon.sft import run_sft

            run_sft(cfg)
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_rl_and_sft_check_output_dir_before_anything_else(tmp_path, kind):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    msg = run_distributed(_run_job, 1, kind, str(blocker / "run"), timeout=300)[0]
    assert msg.startswith(f"output_dir {blocker / 'run'} cannot be written"), msg


def test_pruning_keeps_the_newest_intact_and_leaves_later_steps_for_the_run_to_replace(tmp_path, caplog):
    from archon.checkpoint.manager import COMPLETE, CheckpointManager, manifest

    root = tmp_path / "checkpoints"

    def folder(step: int, marker: bool = True, damaged: bool = False) -> None:
        path = root / f"step_{step}" / "actor"
        path.mkdir(parents=True)
        (path / "shard").write_bytes(b"x" * 10)
        if marker:
            files = manifest(root / f"step_{step}")
            (root / f"step_{step}" / COMPLETE).write_text(json.dumps({"step": step, "files": files}))
        if damaged:
            (path / "shard").write_bytes(b"x" * 3)  # truncated after completion

    for step in (1, 2, 4):
        folder(step)
    folder(3, damaged=True)
    folder(6, marker=False)  # a later step the resumed run has not reached yet
    (root / "step_5.partial").mkdir()
    caplog.set_level(logging.WARNING, logger="archon.checkpoint")
    CheckpointManager(tmp_path, keep_last=2)._prune(4)
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_6"]
    assert any("step_3" in r.getMessage() and "3 bytes, 10 were written" in r.getMessage() for r in caplog.records)
