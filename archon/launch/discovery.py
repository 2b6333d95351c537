"""Finding rollout servers that a cluster launcher started on other nodes: published addresses.

On a cluster the servers of every rollout node are started there, by the launcher's
``python -m archon.launch serve-node`` (``archon.launch``), not by the trainer.  Each
serve-node publishes one record per server once the server answers ``/health`` (or, when
it failed to start, a record that says why, with the last lines of its log), and trainer
rank 0 waits until every server of the plan has a record, instead of launching any.

Where records go is named by ``$ARCHON_SERVER_REGISTRY``, which the launcher exports to
every process of the run:

* ``file:<folder>``: one JSON file per server, written atomically (a temporary file, then a
  rename) in ``<run_dir>/rollout/servers`` on the shared filesystem (Slurm).  The job's
  first step (``FileRegistry.prepare``) creates the folder with a ``launch.json`` naming
  the launch, so a node that cannot see it is told the run directory is not shared;
* ``ray:<namespace>``: a named actor (``ServerDirectory``) in that namespace of the Ray
  cluster at ``$RAY_ADDRESS`` (Ray's own store of named things; the Ray launcher owns it).

Every record carries ``$ARCHON_LAUNCH_ID`` (the Slurm job, the Ray launch), so records left
by an earlier job in the same run directory are never taken for this one's.

``server_source(cfg)`` is what trainer rank 0 calls for its servers: the addresses of
``rollout.server_addrs`` (nothing launched), the published ones (a registry in the
environment), or servers it launches itself on its own node (``RolloutLauncher``).  All three
answer ``start() -> addresses``, ``api_key`` and ``stop()``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from archon.alloc import AllocationError
from archon.config import Config, ConfigError
from archon.errors import ClusterError
from archon.launch.servers import RolloutLauncher, RolloutLaunchError
from archon.plan import Process, plan_for_config
from archon.rollout.client import normalize_addr
from archon.wire.auth import read_api_key

logger = logging.getLogger("archon.launch.discovery")

REGISTRY_ENV = "ARCHON_SERVER_REGISTRY"
"""Where serve-node publishes and the trainer finds servers: ``file:<folder>`` or ``ray:<namespace>``."""
LAUNCH_ID_ENV = "ARCHON_LAUNCH_ID"
"""The launch (Slurm job, Ray launch) that records belong to."""
DIRECTORY_NAME = "archon-rollout-servers"
"""Name of the Ray actor that holds the records (in the launch's own namespace)."""
MARKER = "launch.json"


@dataclass
class ServerRecord:
    """What a serve-node tells the trainer about one server."""

    index: int
    """Server number in the plan."""
    node: int
    """Plan node it runs on."""
    host: str
    """Machine that started it (its log is there)."""
    log_path: str
    """The server's log file on that machine."""
    launch_id: str
    """The launch it belongs to."""
    addr: str = ""
    """host:port clients use; empty when it failed to start."""
    error: str = ""
    """Why it failed to start (with the last lines of its log); empty when it is up."""


def server_log_path(run_dir: Path, index: int) -> Path:
    """Where a server's own log is, on the node that runs it (what ``build_launch_specs`` gives)."""
    return Path(run_dir) / "rollout" / f"server_{index}.log"


def _write_json_atomically(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # readers see the old file or the whole new one, never half of it


class FileRegistry:
    """Records as files in a folder of the run directory on a filesystem every node mounts."""

    def __init__(self, folder: str | Path, launch_id: str):
        self.folder = Path(folder).absolute()
        self.launch_id = launch_id

    @classmethod
    def prepare(cls, folder: str | Path, launch_id: str) -> FileRegistry:
        """The job's first step: create the folder, forget earlier jobs' records, name this launch."""
        reg = cls(folder, launch_id)
        reg.folder.mkdir(parents=True, exist_ok=True)
        for old in reg.folder.glob("server_*.json"):
            old.unlink(missing_ok=True)
        _write_json_atomically(reg.folder / MARKER, {"launch_id": launch_id, "host": socket.gethostname()})
        return reg

    def check(self) -> None:
        """Raise ``ClusterError`` unless this node sees the folder the job's first step prepared."""
        marker = self.folder / MARKER
        try:
            owner = json.loads(marker.read_text()).get("launch_id")
        except (OSError, ValueError):
            raise ClusterError(
                f"the run directory's server folder {self.folder} is missing on {socket.gethostname()}, though the "
                "job's first step created it: output_dir is not on a filesystem that every node mounts; set "
                "output_dir to a shared path (e.g. in your home or project directory)"
            ) from None
        if owner != self.launch_id:
            raise ClusterError(
                f"{marker} on {socket.gethostname()} belongs to launch {owner!r}, not to this one "
                f"({self.launch_id!r}): either output_dir is not on a filesystem every node mounts (this node sees "
                "an old copy), or another job uses the same output_dir; give each job its own shared output_dir"
            )

    def publish(self, record: ServerRecord) -> None:
        _write_json_atomically(self.folder / f"server_{record.index}.json", asdict(record))

    def records(self) -> dict[int, ServerRecord]:
        """This launch's records by server index."""
        found = {}
        for path in self.folder.glob("server_*.json"):
            try:
                record = ServerRecord(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # removed meanwhile, or not a record
            if record.launch_id == self.launch_id:
                found[record.index] = record
        return found

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"the folder {self.folder}"


class ServerDirectory:
    """The Ray actor that holds records (``ray.remote`` is applied by the Ray launcher that owns it)."""

    def __init__(self) -> None:
        self._records: dict[int, dict] = {}

    def publish(self, record: dict) -> None:
        self._records[int(record["index"])] = record

    def records(self) -> list[dict]:
        return list(self._records.values())


class RayRegistry:
    """Records in the launch's ``ServerDirectory`` actor; connects to the Ray cluster at ``$RAY_ADDRESS``."""

    def __init__(self, namespace: str, launch_id: str, address: str | None = None):
        self.namespace = namespace
        self.launch_id = launch_id
        self.address = address
        self._connected = False
        self._actor: Any = None

    def _directory(self) -> Any:
        if self._actor is not None:
            return self._actor
        import ray

        if not ray.is_initialized():
            try:
                ray.init(
                    address=self.address or "auto",
                    namespace=self.namespace,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
            except ConnectionError as exc:
                raise ClusterError(
                    f"cannot reach the Ray cluster at {self.address or '$RAY_ADDRESS'} to find the "
                    f"rollout servers ({exc}); start this process from `python -m archon.launch ray`, "
                    "which exports RAY_ADDRESS"
                ) from None
            self._connected = True
        try:
            self._actor = ray.get_actor(DIRECTORY_NAME, namespace=self.namespace)
        except ValueError:
            raise ClusterError(
                f"no server directory '{DIRECTORY_NAME}' in Ray namespace '{self.namespace}' at "
                f"{self.address}: the launch that exported {REGISTRY_ENV} has ended, or this process "
                "was not started by `python -m archon.launch ray`"
            ) from None
        return self._actor

    def check(self) -> None:
        self._directory()

    def publish(self, record: ServerRecord) -> None:
        import ray

        ray.get(self._directory().publish.remote(asdict(record)))

    def records(self) -> dict[int, ServerRecord]:
        import ray

        found = {}
        for data in ray.get(self._directory().records.remote()):
            record = ServerRecord(**data)
            if record.launch_id == self.launch_id:
                found[record.index] = record
        return found

    def close(self) -> None:
        self._actor = None
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False

    def describe(self) -> str:
        return f"the Ray actor '{DIRECTORY_NAME}' (namespace '{self.namespace}')"


Registry = FileRegistry | RayRegistry


def registry_from_env(env: Mapping[str, str] = os.environ) -> Registry | None:
    """The registry a cluster launcher exported (``$ARCHON_SERVER_REGISTRY``), or None when none did."""
    spec = env.get(REGISTRY_ENV, "")
    if not spec:
        return None
    launch_id = env.get(LAUNCH_ID_ENV, "")
    if not launch_id:
        raise ConfigError(
            f"{REGISTRY_ENV}={spec!r} is set but {LAUNCH_ID_ENV} is not; the cluster launchers "
            "(`python -m archon.launch slurm|ray`) export both"
        )
    kind, _, where = spec.partition(":")
    if kind == "file" and where:
        return FileRegistry(where, launch_id)
    if kind == "ray" and where:
        return RayRegistry(where, launch_id, env.get("RAY_ADDRESS") or None)
    raise ConfigError(f"{REGISTRY_ENV}={spec!r} is neither 'file:<folder>' nor 'ray:<namespace>'")


def run_api_key(run_dir: Path, env: Mapping[str, str] = os.environ) -> str:
    """The launch's API key: ``$ARCHON_API_KEY`` (Ray), else ``<run_dir>/rollout/api_key`` (Slurm)."""
    key = env.get("ARCHON_API_KEY") or read_api_key(Path(run_dir) / "rollout" / "api_key")
    if not key:
        raise ClusterError(
            f"no API key for the rollout servers: ARCHON_API_KEY is unset and "
            f"{Path(run_dir).absolute() / 'rollout' / 'api_key'} does not exist on "
            f"{socket.gethostname()}; the Slurm job's first step writes it there, so output_dir must "
            "be on a filesystem every node mounts"
        )
    return key


class PublishedServers:
    """The servers a cluster launcher started on their nodes: ``start()`` waits for their records."""

    specs: list = []
    """Nothing is launched here: lost servers are dropped, as with ``rollout.server_addrs``."""

    def __init__(
        self,
        registry: Registry,
        servers: Sequence[Process],
        run_dir: Path,
        api_key: str,
        timeout: float,
        poll_s: float = 0.5,
    ):
        self.registry = registry
        self.servers = list(servers)
        self.run_dir = Path(run_dir)
        self.api_key = api_key
        self.timeout = timeout
        self.poll_s = poll_s
        self._addrs: list[str] = []
        self._records: dict[str, ServerRecord] = {}

    @property
    def addrs(self) -> list[str]:
        return list(self._addrs)

    @property
    def key_path(self) -> None:
        return None

    def exited(self) -> dict[int, int]:
        return {}

    def start(self) -> list[str]:
        """Wait until every server of the plan published its address; raise naming the missing ones."""
        self.registry.check()
        deadline = time.monotonic() + self.timeout
        logger.info("waiting for %d rollout server(s) published in %s", len(self.servers), self.registry.describe())
        while True:
            records = self.registry.records()
            failed = [records[s.index] for s in self.servers if s.index in records and records[s.index].error]
            if failed:
                r = failed[0]
                raise RolloutLaunchError(
                    f"rollout server {r.index} on node {r.node} ({r.host}) failed to start "
                    f"({r.log_path} there): {r.error}"
                )
            missing = [s for s in self.servers if s.index not in records]
            if not missing:
                break
            if time.monotonic() > deadline:
                names = "; ".join(
                    f"server {s.index} on node {s.node} (log {server_log_path(self.run_dir, s.index)} on that node)"
                    for s in missing
                )
                raise RolloutLaunchError(
                    f"{len(missing)} rollout server(s) did not publish an address in {self.registry.describe()} "
                    f"within {self.timeout:g} s (rollout.setup_timeout): {names}; check that the launcher started "
                    "their nodes' serve-node step, and raise rollout.setup_timeout if the model is large"
                )
            time.sleep(self.poll_s)
        self._addrs = [records[s.index].addr for s in self.servers]
        self._records = {normalize_addr(records[s.index].addr): records[s.index] for s in self.servers}
        logger.info("rollout servers published: %s", ", ".join(self._addrs))
        return self.addrs

    def log_hint(self, url: str) -> str:
        """Where the log of the server at ``url`` is (for the error that names lost servers)."""
        record = self._records.get(normalize_addr(url))
        return f"its log is {record.log_path} on {record.host}" if record else "its log is on its node"

    def stop(self) -> None:
        """The launcher that started the servers stops them; only the registry connection is closed here."""
        self.registry.close()


def server_source(cfg: Config, env: Mapping[str, str] = os.environ) -> RolloutLauncher | PublishedServers:
    """Where trainer rank 0 gets its servers: given, published by a cluster launcher, or launched here."""
    registry = None if cfg.rollout.server_addrs else registry_from_env(env)
    if registry is None:
        return RolloutLauncher.from_config(cfg, cfg.run_dir)
    try:
        plan = plan_for_config(cfg)
    except AllocationError as exc:
        raise ConfigError(str(exc)) from None
    return PublishedServers(
        registry, plan.servers, cfg.run_dir, run_api_key(cfg.run_dir, env), cfg.rollout.setup_timeout
    )
