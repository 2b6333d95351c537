"""The progress display: plain lines with step/total, elapsed time, ETA and the headline metrics when the
output is not a terminal (a log file), the rich bar when it is."""

from __future__ import annotations

import io
import re

from archon.metrics import MetricsLogger, format_duration


class _Terminal(io.StringIO):
    """A captured stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_plain_lines_carry_step_eta_and_headline_without_control_characters(tmp_path):
    out = io.StringIO()  # not a terminal, like a file or a CI log
    log = MetricsLogger(tmp_path, 4, headline=("reward_mean", "actor/loss"), start_step=1, stream=out)
    for step in (2, 3, 4):
        log.log({"step": step, "reward_mean": step / 8, "actor/loss": 0.5, "entropy": None})
    log.close()
    text = out.getvalue()
    lines = text.splitlines()
    assert len(lines) == 3
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", text), repr(text)  # no escape, \r or other control code
    for step, line in zip((2, 3, 4), lines):
        assert line.startswith(f"step {step}/4  elapsed ")
        assert re.search(r"ETA \d+:\d\d:\d\d", line), line
        assert f"reward_mean={step / 8:.4g}" in line and "actor/loss=0.5" in line
    assert "ETA 0:00:00" in lines[-1]  # the last step leaves nothing to do


def test_terminal_gets_the_rich_bar(tmp_path):
    out = _Terminal()
    log = MetricsLogger(tmp_path, 3, headline=("loss",), stream=out)
    log.log({"step": 1, "loss": 2.0})
    log.close()
    text = out.getvalue()
    assert "\x1b[" in text and "loss=2" in text and "1/3" in text
    assert "elapsed" not in text  # the bar, not the plain lines


def test_format_duration():
    assert format_duration(0) == "0:00:00"
    assert format_duration(59.6) == "0:01:00"
    assert format_duration(3 * 3600 + 2 * 60 + 5) == "3:02:05"
