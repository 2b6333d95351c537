"""Experiment tracking: W&B, TensorBoard and MLflow fed each step's ``metrics.jsonl`` record on rank 0."""

from archon.tracking.base import Tracker, TrackerUnavailable, tracked_values
from archon.tracking.fanout import Trackers, build_trackers

__all__ = ["Tracker", "TrackerUnavailable", "Trackers", "build_trackers", "tracked_values"]
