"""The shared shape of Archon's torchrun entry points: config, overrides, one-line errors, clean exit."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from archon.config import Config, load_config
from archon.config.scheduler import check_launched
from archon.engine.dist import init_distributed, plan_gpu, resolve_device_type, shutdown_distributed
from archon.errors import JobError, user_error_types  # noqa: F401 - JobError is public here
from archon.launch.discovery import LAUNCH_ID_ENV
from archon.plan import Job, plan_for_config
from archon.runtime.cpu_pinning import pin_to_slot


def run_job(
    job: Callable[[Config], Any], description: str | None, argv: Sequence[str] | None = None, kind: str = "rl"
) -> int:
    """Parse ``--config x.toml [dotted.key=value ...]``, run ``job(cfg)``, leave the process group.

    ``kind`` ('rl' or 'sft') is the run's kind for the config check: SFT starts no rollout server.

    A user error (``archon.errors.user_error_types()``) is one line on stderr, printed by one
    rank only, and no traceback: bad input (config, allocation, data, model folder: the
    ``ValueError`` kinds) exits with 2, a failure of the run (a rollout server, the reward
    function, a ``JobError``) with 1.  Anything else is a bug and keeps its traceback.  The
    closing barrier is skipped after a failure, because the other ranks may already be gone.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides (a leading + is accepted)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The openai client's HTTP layer logs every request at INFO: an agent step makes hundreds.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    ok = False
    try:
        cfg = load_config(args.config, args.overrides, job=kind)
        # scheduler.type 'ray'/'slurm' runs are started by python -m archon.launch, which marks its processes.
        check_launched(cfg.scheduler, args.config, args.overrides, launched=bool(os.environ.get(LAUNCH_ID_ENV)))
        job(cfg)
        ok = True
    except user_error_types() as exc:
        if _reports_errors():
            print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    finally:
        shutdown_distributed(barrier=ok)
    return 0


def exit_process(code: int) -> NoReturn:
    """End a training process with ``code`` once ``run_job`` returned: flush the logs and output, then ``os._exit``.

    A process whose gloo groups were destroyed can still abort at interpreter exit ("terminate called without an
    active exception": a gloo thread outlives its group and dies with the statics), which turns a finished run into
    a SIGABRT that torchrun reports as a failed rank.  By the time the job returns, the run has closed all it holds
    (servers, trackers, reward workers, checkpoints), so nothing is lost by skipping the interpreter's teardown.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_run(cfg: Config, job: Job) -> str:
    """Start a training process of a run of ``cfg`` (job 'rl' or 'sft'): its GPU from the cluster plan,
    then the process group.  Returns the device type.  The RL trainer and SFT call this before any engine.
    """
    device_type = resolve_device_type(cfg.device)
    pin = device_type == "cpu" and cfg.cluster.pin_cpu_cores
    plan = plan_for_config(cfg, job) if device_type == "cuda" or pin else None
    if pin and plan is not None:
        # Before the process group and the engines start their threads: those inherit the cores.
        pin_to_slot(plan_gpu(plan), cfg.cluster.n_gpus_per_node, f"training rank {os.environ.get('RANK', '0')}")
    init_distributed(device_type, plan=plan if device_type == "cuda" else None)
    return device_type


def _reports_errors() -> bool:
    """True on exactly one rank of a failed job: the first that failed, else rank 0.

    Every rank usually raises the same error (all parse the same config and data, and rank 0's
    failures are broadcast), so printing it on each would repeat it N times; a rank-local
    failure must still be printed, by the rank that saw it.  The ranks agree through the process
    group's store, or before one exists through torchrun's own store: the first rank to fail
    prints before it exits, so a launcher that stops the other ranks at the first exit cannot stop
    the one that speaks (rank 0 speaking while another rank exits first lost the message under
    load).  With no store to agree through, rank 0 speaks.
    """
    try:
        store = _shared_store()
        if store is not None:
            store.set_timeout(timedelta(seconds=5))  # the store's host may be gone: never hang here
            # torchrun's store outlives a restarted attempt: each attempt agrees afresh.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return store.add(f"archon/error_reported/{attempt}", 1) == 1
    except Exception:  # noqa: BLE001 - no store to agree through: fall back to rank 0
        pass
    return os.environ.get("RANK", "0") == "0"


def _shared_store() -> Any:
    """The process group's store, or torchrun's agent store before the group exists; None elsewhere."""
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_ADDR"):
        port = int(os.environ["MASTER_PORT"])
        return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            os.environ["MASTER_ADDR"], port, is_master=False, timeout=timedelta(seconds=5)
        )
    return None
