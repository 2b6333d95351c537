"""TensorBoard: event files in ``stats_logger.tensorboard.path``, written with torch's SummaryWriter."""

from __future__ import annotations

import json
from typing import Any

from archon.config.stats_logger import TensorBoardConfig
from archon.tracking.base import import_tracker_library


class TensorBoardTracker:
    """Writes each step's numbers as scalars and the run's config as a text summary.

    Every start writes a purge marker at its first step (``purge_step``), so TensorBoard drops the
    events of steps a resumed run redoes, and those of an earlier run in the same folder when a
    run starts over: the curves show what ``metrics.jsonl`` holds.
    """

    def __init__(self, cfg: TensorBoardConfig, run_config: dict[str, Any], start_step: int = 0):
        # torch's writer needs the tensorboard package for its protobufs; without it the import fails.
        tensorboard = import_tracker_library("torch.utils.tensorboard", "tensorboard")
        first = start_step + 1
        self.writer = tensorboard.SummaryWriter(log_dir=cfg.path, purge_step=first)
        # At the first step, not 0: an event below the purge marker would make TensorBoard purge again.
        self.writer.add_text("config", "```json\n" + json.dumps(run_config, indent=1) + "\n```", global_step=first)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        # Flushed every step: a killed run keeps its curves up to its last step.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
