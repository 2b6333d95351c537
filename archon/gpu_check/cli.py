"""``python scripts/gpu_check.py [--device cuda|cpu] [--out table.json] [--only a,b] [--list]``.

Prints each row as it is made, then the whole table; exits 1 if any check failed or errored,
2 on a bad argument.  Without CUDA a ``--device cuda`` run (the default) says so and runs the
CPU checks, reporting the CUDA-only ones as skipped.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from archon.engine.dist import current_device, init_distributed, shutdown_distributed
from archon.gpu_check.registry import CHECKS
from archon.gpu_check.table import Check, Context, Row, failed, format_row, format_table, run_checks, write_json


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="device to check (default cuda)")
    parser.add_argument("--out", type=Path, help="write the table as JSON here")
    parser.add_argument("--only", default="", help="comma-separated check names (see --list)")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every check's time budget")
    parser.add_argument("--workdir", type=Path, help="scratch folder to keep (default: a temporary one)")
    return parser.parse_args(argv)


def select(only: str) -> list[Check]:
    """The checks ``--only`` names, in the registry's order; a name that is not a check raises ValueError."""
    if not only:
        return list(CHECKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {c.name for c in CHECKS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--only names unknown check(s) {', '.join(unknown)}; the checks are: {', '.join(known)}")
    return [c for c in CHECKS if c.name in names]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for c in CHECKS:
            print(f"{c.name:<26} {'cuda' if c.needs_cuda else 'any ':<5} {c.budget_s:>4.0f}s  {c.what}")
        return 0
    try:
        checks = select(args.only)
    except ValueError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    device_type = args.device
    if device_type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here; running the CPU checks (as --device cpu), "
            "CUDA-only checks are reported as skipped"
        )
        device_type = "cpu"
    init_distributed(device_type)
    device = current_device(device_type)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="archon_gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: {len(checks)} checks on {device} (torch {torch.__version__}), scratch {workdir}", flush=True)
    t0 = time.perf_counter()
    done: list[Row] = []

    def report(row: Row) -> None:
        print(format_row(row), flush=True)
        done.append(row)
        if args.out is not None:  # after every row: a run cut short still leaves its table
            write_json(done, args.out, device)

    try:
        rows = run_checks(checks, Context(device, workdir, budget_scale=args.budget_scale), on_row=report)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        shutdown_distributed(barrier=False)
    print(f"\n{format_table(rows)}\ntotal {time.perf_counter() - t0:.1f} s")
    if args.out is not None:
        print(f"gpu_check: table written to {args.out}")
    return 1 if failed(rows) else 0
