"""The check runner: one row per check, each isolated from the others' failures, as a table and as JSON.

A check is a function of a ``Context`` that returns an ``Outcome`` (status, measured figures,
the tolerance it was judged by, a note).  ``run_checks`` times it and turns it into a ``Row``;
an exception becomes an ``error`` row with the exception's one-line text, and the next check
runs.  A CUDA-only check on a CPU run is a ``skip`` row ("needs CUDA") and is never called.
A check that outlives its time budget is interrupted (SIGALRM, main thread only) and reported
as an error, so one hung kernel or server cannot eat the whole session's device time.
"""

from __future__ import annotations

import json
import platform
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

Status = Literal["pass", "fail", "skip", "error"]
NEEDS_CUDA = "skipped: needs CUDA"


@dataclass
class Outcome:
    """What a check found."""

    status: Status
    """pass, fail, skip or error."""
    measured: dict[str, Any] = field(default_factory=dict)
    """The figures it measured, by name (errors, counts, bytes, versions)."""
    tolerance: str = ""
    """What it was judged by, e.g. 'max rel err <= 1e-2'."""
    note: str = ""
    """Why it failed or was skipped, or what it ran on."""


def judge(ok: bool, measured: dict[str, Any], tolerance: str, why_not: str = "", note: str = "") -> Outcome:
    """``pass`` when ``ok``, else ``fail`` with ``why_not`` (or the tolerance) as the note."""
    if ok:
        return Outcome("pass", measured, tolerance, note)
    return Outcome("fail", measured, tolerance, why_not or f"outside tolerance ({tolerance})")


def skip(reason: str, measured: dict[str, Any] | None = None) -> Outcome:
    return Outcome("skip", measured or {}, "", f"skipped: {reason}")


@dataclass
class Context:
    """What every check gets: the device it checks and a scratch folder."""

    device: torch.device
    """cuda:N for a GPU run, cpu otherwise."""
    workdir: Path
    """A scratch folder for this run (model folders, checkpoints, server logs)."""
    budget_scale: float = 1.0
    """Multiplies every check's time budget (slow or shared machines)."""
    cache: dict[str, Any] = field(default_factory=dict)
    """Artifacts several checks share (e.g. a tiny model folder), by name."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(frozen=True)
class Check:
    """One named check."""

    name: str
    """Row name; what ``--only`` selects."""
    fn: Callable[[Context], Outcome]
    """The check itself."""
    needs_cuda: bool
    """Reported as skipped (never run) on a CPU run."""
    budget_s: float
    """Seconds it may take on its device before it is interrupted (times ``Context.budget_scale``)."""
    what: str
    """One line: what it checks."""


@dataclass
class Row:
    """One line of the table."""

    name: str
    status: Status
    measured: dict[str, Any]
    tolerance: str
    seconds: float
    note: str


class CheckTimeout(Exception):
    """A check ran past its time budget."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``CheckTimeout`` in this (main) thread after ``seconds``; a no-op off the main thread."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CheckTimeout(f"over its time budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, and where it was raised."""
    text = str(exc).strip().splitlines()
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {text[0] if text else ''}{where}"


def run_check(check: Check, ctx: Context) -> Row:
    """Run one check; never raises (but for KeyboardInterrupt)."""
    if check.needs_cuda and not ctx.cuda:
        return Row(check.name, "skip", {}, "", 0.0, NEEDS_CUDA)
    t0 = time.perf_counter()
    try:
        with time_limit(check.budget_s * ctx.budget_scale):
            out = check.fn(ctx)
            if ctx.cuda:
                torch.cuda.synchronize(ctx.device)  # a kernel's asynchronous error belongs to this row
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one check's failure must not stop the others
        return Row(check.name, "error", {}, "", round(time.perf_counter() - t0, 2), one_line(exc))
    return Row(check.name, out.status, out.measured, out.tolerance, round(time.perf_counter() - t0, 2), out.note)


def run_checks(checks: Sequence[Check], ctx: Context, on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Every check in order, one row each; ``on_row`` sees each row as soon as it exists."""
    rows = []
    for check in checks:
        row = run_check(check, ctx)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def failed(rows: Sequence[Row]) -> bool:
    return any(r.status in ("fail", "error") for r in rows)


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_figure(v) for v in value) + "]"
    return str(value)


def format_measured(measured: dict[str, Any]) -> str:
    return "; ".join(f"{k}={_figure(v)}" for k, v in measured.items())


def format_row(row: Row) -> str:
    text = f"{row.name:<24} {row.status:<5} {row.seconds:>7.1f}s  {format_measured(row.measured)}"
    if row.tolerance:
        text += f"  [{row.tolerance}]"
    if row.note:
        text += f"  -- {row.note}"
    return text


def format_table(rows: Sequence[Row]) -> str:
    """A plain-text table: name, status, seconds, figures, tolerance, note."""
    head = f"{'check':<24} {'status':<5} {'seconds':>8}  measured  [tolerance]  -- note"
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "error", "skip")}
    tail = ", ".join(f"{n} {s}" for s, n in counts.items())
    return "\n".join([head, *(format_row(r) for r in rows), tail])


def environment_summary(device: torch.device) -> dict[str, Any]:
    """Where the table was made (goes into the JSON next to the rows)."""
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def write_json(rows: Sequence[Row], path: str | Path, device: torch.device) -> None:
    """``{"environment": {...}, "rows": [{name, status, measured, tolerance, seconds, note}, ...]}``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"environment": environment_summary(device), "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
