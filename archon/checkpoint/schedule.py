"""When a run saves a resumable checkpoint: every ``saver.freq_steps`` steps, every ``saver.freq_secs`` seconds of
training (on by default, so that an interrupted run written from scratch loses at most that much), and at the end.

The decision is collective: every rank saves at the same step.  Steps are the same on every rank; wall-clock time
is not, so rank 0's clock decides and the other ranks learn its answer (one small broadcast per step, only while
``freq_secs`` is on and the run has more than one rank).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from archon.config import SaverConfig


class SaveSchedule:
    """``due(step)``: whether step ``step`` ends with a checkpoint (call it on every rank, every step)."""

    def __init__(self, saver: SaverConfig, total_steps: int):
        self.freq_steps = saver.freq_steps
        self.freq_secs = saver.freq_secs
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
