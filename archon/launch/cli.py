"""``python -m archon.launch``: start a run on a cluster with Slurm or Ray.

    python -m archon.launch slurm --config x.toml [--submit | --dry-run] [--sbatch-arg=--partition=gpu] [overrides]
    python -m archon.launch ray --config x.toml [--address HEAD:6379] [overrides]

Run on the node the cluster is reached from (a Slurm login node, any Ray node), in the
directory the run's relative paths start from.  Internal, run on the nodes by those two:

    python -m archon.launch prepare --config x.toml [overrides]
    python -m archon.launch serve-node --config x.toml --node N [--server I] [overrides]

A mistake in the input (config, layout, cluster) is one sentence on stderr and exit code 2;
a failed run exits with 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from archon.config import load_config
from archon.errors import user_error_types
from archon.launch.common import load_run
from archon.launch.ray_cluster import launch_ray
from archon.launch.serve import prepare_run, serve_node
from archon.launch.slurm import build_job, default_script_path, dry_run_text, log_path, render_script, submit

COMMANDS = ("slurm", "ray", "serve-node", "prepare")


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m archon.launch {command}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides (a leading + is accepted)")
    if command in ("slurm", "ray"):
        parser.add_argument("--job", choices=("rl", "sft"), default="rl", help="an RL run (default) or SFT")
    if command == "slurm":
        parser.add_argument("--submit", action="store_true", help="submit the script with sbatch")
        parser.add_argument("--dry-run", action="store_true", help="print each node's commands and environment")
        parser.add_argument("--script", help="where to write the script (default <run_dir>/launch/slurm.sbatch)")
        parser.add_argument("--rdzv-port", type=int, default=29500, help="torchrun's c10d rendezvous port")
        parser.add_argument(
            "--sbatch-arg",
            action="append",
            default=[],
            metavar="ARG",
            help="an extra #SBATCH line, e.g. --sbatch-arg=--partition=gpu (repeatable)",
        )
    elif command == "ray":
        parser.add_argument("--address", help="a running Ray cluster's head (host:port); omitted: a local Ray")
        parser.add_argument("--cpus-per-gpu", type=float, default=1.0, help="CPUs reserved with each GPU bundle")
        parser.add_argument(
            "--placement-timeout", type=float, default=120.0, help="seconds to wait for Ray to reserve a node's GPUs"
        )
    elif command == "serve-node":
        parser.add_argument("--node", type=int, required=True, help="plan node whose servers to start")
        parser.add_argument("--server", type=int, action="append", help="only this server of the node (repeatable)")
        parser.add_argument("--gpus", help="GPU ids for the selected server (when the launcher bound GPUs itself)")
        parser.add_argument("--host", help="address other nodes reach this node at (default: its host name)")
    return parser


def _slurm(args: argparse.Namespace) -> int:

    cfg, plan = load_run(args.config, args.overrides, args.job)
    job = build_job(cfg, plan, args.config, args.overrides, args.job, args.rdzv_port, args.sbatch_arg)
    if args.dry_run:
        print(dry_run_text(job, cfg))
        return 0
    script = Path(args.script) if args.script else default_script_path(job)
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(render_script(job))
    script.chmod(0o755)
    log_path(job).parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {script}")
    if args.submit:
        print(submit(script))
    else:
        print(f"submit it with: sbatch {script}")
    return 0


def _ray(args: argparse.Namespace) -> int:

    cfg, plan = load_run(args.config, args.overrides, args.job)
    return launch_ray(
        cfg, plan, args.config, args.overrides, args.job, args.address, args.cpus_per_gpu, args.placement_timeout
    )


def _serve_node(args: argparse.Namespace) -> int:

    cfg = load_config(args.config, args.overrides)
    return serve_node(cfg, args.node, args.server, args.gpus, args.host)


def _prepare(args: argparse.Namespace) -> int:

    prepare_run(load_config(args.config, args.overrides))
    return 0


_RUN = {"slurm": _slurm, "ray": _ray, "serve-node": _serve_node, "prepare": _prepare}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print((__doc__ or "").strip(), file=sys.stderr)
        if argv and argv[0] in ("-h", "--help"):
            return 0
        print(f"\nerror: the first argument must be one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    command = argv[0]
    args = _parser(command).parse_intermixed_args(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return _RUN[command](args)
    except user_error_types() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        print("interrupted: every process this launcher started was stopped", file=sys.stderr)
        return 130
