"""When runs save: by steps, by training time (on by default), and always at the end."""

from __future__ import annotations

import pytest

from archon.checkpoint import schedule as schedule_module
from archon.checkpoint.schedule import SaveSchedule
from archon.config import SaverConfig


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _saved_steps(monkeypatch, saver: SaverConfig, step_s: list[float], total: int) -> list[int]:
    clock = _Clock()
    monkeypatch.setattr(schedule_module.time, "monotonic", clock)
    schedule = SaveSchedule(saver, total)
    saved = []
    for step in range(1, total + 1):
        clock.now += step_s[step - 1]
        if schedule.due(step):
            saved.append(step)
    return saved


def test_a_default_saver_checkpoints_every_hour_of_training_and_at_the_end(monkeypatch):
    assert SaverConfig().freq_secs == 3600
    # Steps of 25 minutes: an hour has passed after step 3 (75 min), then again after step 6.
    assert _saved_steps(monkeypatch, SaverConfig(), [1500.0] * 7, 7) == [3, 6, 7]


@pytest.mark.parametrize(
    ("saver", "saved"),
    [
        (SaverConfig(freq_steps=2, freq_secs=0), [2, 4, 5]),
        (SaverConfig(freq_steps=0, freq_secs=0), [5]),
        # The clock restarts at every save, whatever made it.
        (SaverConfig(freq_steps=2, freq_secs=250), [2, 4, 5]),
        (SaverConfig(freq_steps=0, freq_secs=250), [3, 5]),
    ],
)
def test_steps_time_and_the_end_each_make_a_checkpoint(monkeypatch, saver, saved):
    assert _saved_steps(monkeypatch, saver, [100.0] * 5, 5) == saved
