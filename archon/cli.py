"""The shared shape of Archon's torchrun entry points: config, overrides, one-line errors, clean exit."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Callable, Sequence

from archon.config import Config, ConfigError, load_config
from archon.engine.dist import init_distributed, resolve_device_type, shutdown_distributed


class JobError(RuntimeError):
    """A job failed for a reason every rank knows and can state in one line (no traceback needed)."""


def run_job(job: Callable[[Config], Any], description: str, argv: Sequence[str] | None = None,
            kind: str = "rl") -> int:
    """Parse ``--config x.toml [dotted.key=value ...]``, run ``job(cfg)``, leave the process group.

    ``kind`` ('rl' or 'sft') is the run's kind for the config check: SFT starts no rollout server.

    User errors (config, allocation, data: ``ValueError``) exit with 2 and one line on stderr;
    a ``JobError`` exits with 1 and one line.  The closing barrier is skipped after a failure,
    because the other ranks may already be gone.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides (a leading + is accepted)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ok = False
    try:
        job(load_config(args.config, args.overrides, job=kind))
        ok = True
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed(barrier=ok)
    return 0


def init_run(cfg: Config, job: str) -> str:
    """Start a training process of a run of ``cfg`` (job 'rl' or 'sft'): its GPU from the cluster plan,
    then the process group.  Returns the device type.  The RL trainer and SFT call this before any engine.
    """
    from archon.plan import plan_for_config

    device_type = resolve_device_type(cfg.device)
    init_distributed(device_type, plan=plan_for_config(cfg, job) if device_type == "cuda" else None)
    return device_type
