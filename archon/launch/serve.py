"""The two commands a cluster launcher runs on the nodes: ``prepare`` and ``serve-node``.

``python -m archon.launch prepare --config x.toml [overrides]`` is the Slurm job's first
command: it creates the run directory's server folder (``<run_dir>/rollout/servers``, where
records of earlier jobs are removed and ``launch.json`` names this one) and writes a fresh
API key to ``<run_dir>/rollout/api_key`` (owner-only), both on the shared filesystem.

``python -m archon.launch serve-node --config x.toml --node N [--server I] [overrides]``
starts the rollout servers the plan puts on node N (``build_launch_specs(cfg, node=N)``,
each with ``CUDA_VISIBLE_DEVICES`` = its GPUs), waits until they answer ``/health``,
publishes their addresses (``archon.launch.discovery``) and stays up, watching them, until
it is stopped (SIGTERM or SIGINT), which stops its servers.  A server that fails to start is
published as failed, with the last lines of its log, so the trainer stops at once with the
reason; a server that dies later is reported the same way in this process's log, and the
trainer drops it.  Ray runs one serve-node per server (``--server I``) and passes the GPU ids
Ray gave it (``--gpus``) and the node's address (``--host``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence

from archon.config import Config, ConfigError
from archon.launch.discovery import (
    LAUNCH_ID_ENV,
    REGISTRY_ENV,
    FileRegistry,
    ServerRecord,
    registry_from_env,
    run_api_key,
)
from archon.launch.servers import RolloutLauncher, RolloutLaunchError, build_launch_specs
from archon.wire.auth import generate_api_key, write_api_key

logger = logging.getLogger("archon.launch")

_WATCH_INTERVAL_S = 1.0


class _Stopped(Exception):
    """SIGTERM or SIGINT: the launcher asks this node's servers to stop."""


def prepare_run(cfg: Config, env: Mapping[str, str] = os.environ) -> FileRegistry:
    """Create the server folder of a Slurm job in the shared run directory, and a fresh API key."""
    registry = registry_from_env(env)
    if not isinstance(registry, FileRegistry):
        raise ConfigError(
            f"`python -m archon.launch prepare` sets up a Slurm job's run directory and needs "
            f"{REGISTRY_ENV}=file:<folder> and {LAUNCH_ID_ENV} (the sbatch script exports them)"
        )
    registry = FileRegistry.prepare(registry.folder, registry.launch_id)
    write_api_key(cfg.run_dir / "rollout" / "api_key", generate_api_key())
    logger.info("run directory %s prepared for launch %s", cfg.run_dir.absolute(), registry.launch_id)
    return registry


def _select(specs: list, node: int, servers: Sequence[int] | None) -> list:
    if servers is None:
        return specs
    known = {s.index for s in specs}
    unknown = [i for i in servers if i not in known]
    if unknown:
        raise ConfigError(
            f"--server {','.join(map(str, unknown))}: the plan puts servers "
            f"{sorted(known) or 'none'} on node {node} (`python -m archon.plan` shows the layout)"
        )
    return [s for s in specs if s.index in servers]


def serve_node(
    cfg: Config, node: int, servers: Sequence[int] | None = None, gpus: str | None = None, host: str | None = None
) -> int:
    """Start node ``node``'s servers (or ``servers`` of them), publish them, watch them until stopped.

    ``gpus``: the GPU ids of the one selected server's process, when the launcher bound GPUs
    itself (Ray); otherwise each server gets the plan's node-local ids.  ``host``: the address
    other nodes reach this node at (default: its host name).  Returns 0 when stopped, 1 when
    every server has died.
    """
    registry = registry_from_env()
    if registry is None:
        raise ConfigError(
            f"serve-node publishes its servers for a trainer started by a cluster launcher, but "
            f"{REGISTRY_ENV} is unset; start runs with `python -m archon.launch slurm|ray`"
        )
    registry.check()
    api_key = run_api_key(cfg.run_dir)
    # With --gpus the launcher bound this process's devices (Ray): CUDA_VISIBLE_DEVICES is the server's own already.
    specs = _select(
        build_launch_specs(cfg, cfg.run_dir, node=node, api_key=api_key, map_visible_devices=gpus is None),
        node,
        servers,
    )
    if gpus is not None:
        if len(specs) != 1:
            raise ConfigError("--gpus gives the GPU ids of one server's process; select that server with --server")
        if specs[0].env.get("CUDA_VISIBLE_DEVICES"):  # the built-in server runs on the CPU and keeps ''
            specs[0].env["CUDA_VISIBLE_DEVICES"] = gpus
    advertised = host or os.environ.get("ARCHON_ADVERTISE_HOST")
    for spec in specs:
        if advertised and spec.host in ("0.0.0.0", "::"):
            spec.connect_host = advertised
    where = socket.gethostname()

    def record(spec, **kw) -> ServerRecord:
        return ServerRecord(spec.index, node, where, str(spec.log_path.absolute()), registry.launch_id, **kw)

    def stop_on_signal(signum: int, frame: object) -> None:
        raise _Stopped()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_on_signal)
    launcher = RolloutLauncher(specs, setup_timeout=cfg.rollout.setup_timeout, write_key_file=False)
    try:
        try:
            launcher.start()
        except RolloutLaunchError as exc:
            for spec in specs:
                registry.publish(record(spec, error=str(exc)))
            raise
        for spec in specs:
            registry.publish(record(spec, addr=spec.addr))
        logger.info(
            "node %d: published rollout server(s) %s in %s",
            node,
            ", ".join(f"{s.index} at {s.addr}" for s in specs),
            registry.describe(),
        )
        alive = {s.index for s in specs}
        while alive:
            time.sleep(_WATCH_INTERVAL_S)
            for index, code in sorted(launcher.exited().items()):
                if index in alive:
                    alive.discard(index)
                    logger.error(
                        "rollout server %d on node %d exited with code %s; last lines of %s:\n%s",
                        index,
                        node,
                        code,
                        launcher.log_path(index),
                        launcher.log_tail(index, 20),
                    )
        raise RolloutLaunchError(f"every rollout server of node {node} has exited (their logs are above)")
    except _Stopped:
        logger.info("node %d: stopping its rollout servers", node)
        return 0
    finally:
        launcher.stop()
        registry.close()
