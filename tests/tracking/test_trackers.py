"""Each tracker, offline and with no network, read back with its library's own reader.

A ``MetricsLogger`` logs a few steps (numbers, a bool, a None, a NaN and a string, as the
trainers' records hold); the test then compares what the library stored with the records it was
given (same steps, same finite numbers, nothing else) and with the config it was started with.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from archon.config import Config
from archon.metrics import MetricsLogger
from archon.tracking import TrackerUnavailable, build_trackers, tracked_values
from archon.tracking.base import RUN_IDS_FILE


def _records(scale: float = 1.0, steps: range = range(1, 4)) -> list[dict]:
    return [
        {
            "step": s,
            "reward_mean": scale * s / 4,
            "actor/loss": scale * (1.0 - s / 8),
            "response_len_mean": 10 * s,
            "update_skipped": s == 2,
            "entropy": None,
            "kl_penalty": math.nan,
            "note": "text",
        }
        for s in steps
    ]


def _expected(records: list[dict]) -> dict[str, dict[int, float]]:
    """Key -> {step: value}: what a tracker must hold, worked out by hand from the records."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for key in ("reward_mean", "actor/loss", "response_len_mean"):
            out.setdefault(key, {})[r["step"]] = float(r[key])
        out.setdefault("update_skipped", {})[r["step"]] = 1.0 if r["update_skipped"] else 0.0
    return out


def _log(cfg: Config, records: list[dict], start_step: int = 0) -> None:
    log = MetricsLogger(cfg.run_dir, 3, run_config=cfg, start_step=start_step, stream=io.StringIO())
    for record in records:
        log.log(record)
    log.close()


def _config(tmp_path: Path) -> Config:
    cfg = Config(experiment_name="tracktest", trial_name="t1", output_dir=str(tmp_path / "run"))
    cfg.actor.optimizer.lr = 3e-6
    return cfg


def test_tracked_values_keep_finite_numbers_only():
    record = {"step": 4, "a": 1, "b": 0.5, "c": True, "d": None, "e": math.inf, "f": "x", "g": [1]}
    assert tracked_values(record) == {"a": 1.0, "b": 0.5, "c": 1.0}


def _tensorboard(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_holds_the_logged_steps_and_the_config(tmp_path):
    cfg = _config(tmp_path)
    cfg.stats_logger.tensorboard.path = str(tmp_path / "tb")
    records = _records()
    _log(cfg, records)
    acc = _tensorboard(tmp_path / "tb")
    expected = _expected(records)
    assert set(acc.Tags()["scalars"]) == set(expected)
    for key, by_step in expected.items():
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert got == pytest.approx(by_step, rel=1e-6), key  # event files store float32
    (config_event,) = acc.Tensors("config/text_summary")
    text = config_event.tensor_proto.string_val[0].decode()
    recorded = json.loads(text.removeprefix("```json\n").removesuffix("\n```"))
    assert recorded["trial_name"] == "t1" and recorded["actor"]["optimizer"]["lr"] == 3e-6
    assert recorded["stats_logger"]["tensorboard"]["path"] == str(tmp_path / "tb")


def test_tensorboard_resume_replaces_the_redone_steps(tmp_path):
    cfg = _config(tmp_path)
    cfg.stats_logger.tensorboard.path = str(tmp_path / "tb")
    _log(cfg, _records())
    # Resumed from a checkpoint at step 1: steps 2 and 3 are done again, with other values.
    redone = _records(scale=-2.0, steps=range(2, 4))
    _log(cfg, redone, start_step=1)
    acc = _tensorboard(tmp_path / "tb")
    expected = _expected(_records(steps=range(1, 2)) + redone)
    for key, by_step in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in sorted(by_step.items())], key
    # metrics.jsonl holds the same steps and values.
    lines = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and lines[1]["reward_mean"] == redone[0]["reward_mean"]


def test_mlflow_holds_the_logged_steps_params_and_resumes_the_same_run(tmp_path):
    cfg = _config(tmp_path)
    uri = (tmp_path / "mlruns").as_uri()
    cfg.stats_logger.mlflow.tracking_uri = uri
    cfg.stats_logger.mlflow.tags = {"team": "rl"}
    records = _records()
    _log(cfg, records)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tracktest")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "t1" and run.data.tags["team"] == "rl" and run.info.status == "FINISHED"
    assert run.data.params["actor.optimizer.lr"] == "3e-06"
    assert run.data.params["stats_logger.mlflow.tracking_uri"] == uri
    expected = _expected(records)
    assert set(run.data.metrics) == set(expected)
    for key, by_step in expected.items():
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} == by_step, key

    # A resumed run continues the same MLflow run.
    _log(cfg, _records(steps=range(4, 5)), start_step=3)
    (again,) = client.search_runs([run.info.experiment_id])
    assert again.info.run_id == run.info.run_id
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]


def _wandb_records(run_file: Path) -> list[dict]:
    """The records of an offline run's transaction log, read by wandb's own inspector."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_wandb_offline_holds_the_logged_steps_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    cfg = _config(tmp_path)
    cfg.stats_logger.wandb.mode = "offline"
    cfg.stats_logger.wandb.tags = ["ci", "cpu"]
    records = _records()
    _log(cfg, records)
    run_id = json.loads((cfg.run_dir / RUN_IDS_FILE).read_text())["wandb"]
    (run_file,) = (cfg.run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    logged = _wandb_records(run_file)
    (run,) = [r["run"] for r in logged if r.get("type") == "run"]
    assert run["project"] == "tracktest" and run["display_name"] == "t1" and run["tags"] == ["ci", "cpu"]
    config = run["config"]["update"]
    assert config["actor"]["optimizer"]["lr"] == 3e-6 and config["stats_logger"]["wandb"]["mode"] == "offline"
    history = [r["history"] for r in logged if r.get("type") == "history"]
    assert [h["step"]["num"] for h in history] == [1, 2, 3]
    got: dict[str, dict[int, float]] = {}
    for h in history:
        for key, value in h["item"].items():
            if not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                got.setdefault(key, {})[h["step"]["num"]] = value
    assert got == _expected(records)

    # A resumed run asks for the same W&B run id.
    _log(cfg, _records(steps=range(3, 4)), start_step=2)
    assert len(list((cfg.run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))) == 2


def test_trackers_start_only_on_rank_0(tmp_path):
    cfg = _config(tmp_path)
    cfg.stats_logger.tensorboard.path = str(tmp_path / "tb")
    log = MetricsLogger(cfg.run_dir, 3, enabled=False, run_config=cfg, stream=io.StringIO())
    log.log(_records()[0])
    log.close()
    assert not (tmp_path / "tb").exists() and not cfg.run_dir.exists()


def test_a_missing_tracker_package_names_the_extra(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    cfg.stats_logger.tensorboard.path = str(tmp_path / "tb")
    cfg.stats_logger.mlflow.tracking_uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # import of it raises ImportError
    with pytest.raises(TrackerUnavailable, match=r"stats_logger\.mlflow .*pip install 'archon\[track\]'"):
        build_trackers(cfg)
