"""The configured trackers behind one ``log``/``close``, built from a run's config."""

from __future__ import annotations

import contextlib

from archon.config.schema import Config
from archon.tracking.base import Tracker, config_dict
from archon.tracking.mlflow_tracker import MLflowTracker
from archon.tracking.tensorboard_tracker import TensorBoardTracker
from archon.tracking.wandb_tracker import WandBTracker


class Trackers:
    """Feeds every tracker the same step; closes all of them even when one fails."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        failure: BaseException | None = None
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as exc:  # the others still get closed; the first failure is raised after
                failure = failure or exc
        if failure is not None:
            raise failure


def build_trackers(cfg: Config, start_step: int = 0) -> Trackers:
    """The trackers ``cfg.stats_logger`` turns on, each with the whole config recorded; call on rank 0 only.

    ``start_step`` is the last step already done (a resumed run's checkpoint), 0 for a new run.
    """
    stats = cfg.stats_logger
    run_config = config_dict(cfg)
    built = Trackers([])
    try:
        if stats.wandb.mode != "disabled":
            built.trackers.append(
                WandBTracker(stats.wandb, run_config, cfg.run_dir, cfg.experiment_name, cfg.trial_name, start_step)
            )
        if stats.tensorboard.path:
            built.trackers.append(TensorBoardTracker(stats.tensorboard, run_config, start_step))
        if stats.mlflow.tracking_uri:
            built.trackers.append(
                MLflowTracker(stats.mlflow, run_config, cfg.run_dir, cfg.experiment_name, cfg.trial_name, start_step)
            )
    except BaseException:
        # The trackers already started end their runs; the error that stopped the start is the one raised.
        with contextlib.suppress(Exception):
            built.close()
        raise
    return built
