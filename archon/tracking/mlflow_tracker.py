"""MLflow: one MLflow run per Archon run, through ``MlflowClient`` (no global active run)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from archon.config.stats_logger import MLflowConfig
from archon.tracking.base import flatten, import_tracker_library, load_run_id, save_run_id

PARAM_VALUE_MAX = 6000
"""Longest parameter value MLflow stores; longer config values are cut to it."""
PARAMS_PER_BATCH = 100
"""Parameters per ``log_batch`` call (MLflow's limit)."""
METRICS_PER_BATCH = 1000
"""Metric values per ``log_batch`` call (MLflow's limit)."""


def mlflow_key(key: str) -> str:
    """``key`` with the characters MLflow refuses in metric and parameter names replaced by '_'."""
    return re.sub(r"[^\w\-. /]", "_", key)


def is_local_store(uri: str) -> bool:
    """Whether ``uri`` names MLflow's file store (``file:`` or a bare path) rather than a server or database."""
    return uri.startswith("file:") or "://" not in uri


class MLflowTracker:
    """Logs each step's numbers as MLflow metrics and the run's config (flattened) as parameters.

    A resumed run (``start_step > 0``) continues the MLflow run whose id the run directory keeps.
    MLflow cannot delete metric values, so a step a resumed run redoes holds two values, the
    later one last in its history.  Parameters are logged once, at the first start (MLflow
    refuses to change one).
    """

    def __init__(
        self,
        cfg: MLflowConfig,
        run_config: dict[str, Any],
        run_dir: Path,
        default_experiment: str,
        default_run_name: str,
        start_step: int = 0,
    ):
        tracking = import_tracker_library("mlflow.tracking", "mlflow")
        entities = import_tracker_library("mlflow.entities", "mlflow")
        self._metric = entities.Metric
        if is_local_store(cfg.tracking_uri):
            # MLflow 3 refuses its file store unless opted in; it is the store mlflow-skinny can write
            # without a server or a database (the offline mode).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = tracking.MlflowClient(tracking_uri=cfg.tracking_uri)
        name = cfg.experiment_name or default_experiment
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        run_id = load_run_id(run_dir, "mlflow") if start_step > 0 else None
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=cfg.run_name or default_run_name, tags=cfg.tags)
            run_id = run.info.run_id
            save_run_id(run_dir, "mlflow", run_id)
            params = [
                entities.Param(mlflow_key(key), str(value)[:PARAM_VALUE_MAX])
                for key, value in flatten(run_config).items()
            ]
            for i in range(0, len(params), PARAMS_PER_BATCH):
                self.client.log_batch(run_id, params=params[i : i + PARAMS_PER_BATCH])
        self.run_id: str = run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(mlflow_key(key), value, now, step) for key, value in metrics.items()]
        for i in range(0, len(batch), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + METRICS_PER_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
