"""When periodic work of a run is due: every N steps, every N seconds of training, and at the end.  Checkpoints use
it (``SaveSchedule``: ``saver.freq_steps`` / ``saver.freq_secs``, time on by default, so that an interrupted run
written from scratch loses at most that much), and so do evaluations (``archon.eval.periodic``).

The decision is collective: every rank acts at the same step.  Steps are the same on every rank; wall-clock time
is not, so rank 0's clock decides and the other ranks learn its answer (one small broadcast per step, only while
``freq_secs`` is on and the run has more than one rank).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from archon.config import SaverConfig


class IntervalSchedule:
    """``due(step)``: whether step ``step`` ends with the work (call it on every rank, every step); the seconds
    count from the last step that was due."""

    def __init__(self, freq_steps: int, freq_secs: float, total_steps: int):
        self.freq_steps = freq_steps
        self.freq_secs = freq_secs
        self.total_steps = total_steps
        self._last = time.monotonic()

    def due(self, step: int) -> bool:
        by_steps = bool(self.freq_steps) and step % self.freq_steps == 0
        by_time = self.freq_secs > 0 and self._clock_says_due()
        if step == self.total_steps or by_steps or by_time:
            self._last = time.monotonic()
            return True
        return False

    def _clock_says_due(self) -> bool:
        due = time.monotonic() - self._last >= self.freq_secs
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [due]
            dist.broadcast_object_list(box, src=0)
            due = bool(box[0])
        return due


class SaveSchedule(IntervalSchedule):
    """When a run saves a resumable checkpoint (``saver.freq_steps``, ``saver.freq_secs``, the end)."""

    def __init__(self, saver: SaverConfig, total_steps: int):
        super().__init__(saver.freq_steps, saver.freq_secs, total_steps)
