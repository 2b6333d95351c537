"""``python -m archon.launch ray``: the run's processes on a Ray cluster, placed as the plan says.

Ray does the placing; Archon only asks for what the plan says:

1. Each plan node that runs something is mapped to one Ray node with enough GPUs, and gets a
   placement group there: one bundle ``{"GPU": 1, "CPU": c}`` per GPU the plan uses on it,
   ``STRICT_PACK``, pinned to that node by its ``ray.io/node-id`` label.
2. One small actor (``ProcessSlot``) holds each bundle's GPU; Ray tells it which GPU id that
   is.  Colocated (``rollout.colocate``), a GPU's server and training rank share its bundle:
   two slots of half a GPU each, to which Ray gives the same id.  Every process of the run is
   started by its slot of its first GPU, as a child process with ``CUDA_VISIBLE_DEVICES`` = the
   ids Ray gave the process's slots:

   * a rollout server: ``python -m archon.launch serve-node --node n --server i`` (the node's
     address and the GPU ids passed along), which publishes its address in the launch's
     ``ServerDirectory`` actor once healthy (``archon.launch.discovery``);
   * a training rank: ``scripts/train_rl.py`` with the variables torchrun would give it
     (``MASTER_ADDR``/``MASTER_PORT`` on rank 0's node, ``RANK``, ``WORLD_SIZE``,
     ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``), the ranks numbered as in the plan.

3. Trainer rank 0 finds the servers in the directory (it connects to Ray through
   ``RAY_ADDRESS``); the run's API key reaches every process in its environment.
4. The launcher watches the processes until training ends: a training rank that fails ends
   the run with the last lines of its log, a server that dies is reported the same way; on
   any exit, Ctrl-C included, it stops every process it started and returns the GPUs.

Each process logs to ``<run_dir>/launch/<name>.log`` on its node; rank 0's and the servers'
lines are also shown by the launcher.  ``<run_dir>/launch/ray_placement.json`` records where
every process ran (Ray node, address, the ``CUDA_VISIBLE_DEVICES`` it got).  The working
directory, config, model and data must be at the same paths on every node (a shared
filesystem or the same image), as with any multi-node run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archon.config import Config
from archon.errors import ClusterError
from archon.launch.common import LaunchError, entry_point, run_args
from archon.launch.discovery import DIRECTORY_NAME, LAUNCH_ID_ENV, REGISTRY_ENV, ServerDirectory
from archon.launch.servers import die_with_parent
from archon.plan import ClusterPlan, Job, Process
from archon.wire.auth import API_KEY_ENV, generate_api_key

logger = logging.getLogger("archon.launch")

_POLL_S = 1.0
_STOP_GRACE_S = 15.0
_TAIL_LINES = 30
_FAILURE_GRACE_S = 20.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ClusterError("the Ray launcher needs Ray, which is not installed; pip install 'archon[ray]'") from None
    return ray


class ProcessSlot:
    """A Ray actor holding one GPU bundle; the slot of a process's first GPU runs that process."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._tail: deque[str] = deque(maxlen=200)
        self._log_path = ""

    def where(self) -> dict[str, Any]:
        """The Ray node, its address and the GPU ids Ray gave this slot."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(
        self, name: str, argv: list[str], env: dict[str, str], cwd: str, log_path: str, echo: bool
    ) -> dict[str, Any]:
        """Start ``argv`` (``python`` is this node's interpreter) in its own session; what it got."""
        argv = [sys.executable if i == 0 and a == "python" else a for i, a in enumerate(argv)]
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self._log_path = log_path
        # Ray's own variables stay: the run's processes connect back to the cluster with them.
        self._proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        threading.Thread(target=self._copy_output, args=(name, log_path, echo), daemon=True).start()
        return {"pid": self._proc.pid, "CUDA_VISIBLE_DEVICES": self._environ().get("CUDA_VISIBLE_DEVICES")}

    def _environ(self) -> dict[str, str]:
        """The started process's own environment (Linux), else what it was given."""
        assert self._proc is not None
        try:
            raw = Path(f"/proc/{self._proc.pid}/environ").read_bytes()
            return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        except OSError:
            return {}

    def _copy_output(self, name: str, log_path: str, echo: bool) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with open(log_path, "ab") as log:
            for line in self._proc.stdout:
                log.write(line)
                log.flush()
                text = line.decode(errors="replace").rstrip("\n")
                self._tail.append(text)
                if echo:
                    print(f"[{name}] {text}", flush=True)

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def tail(self, lines: int = _TAIL_LINES) -> str:
        return "\n".join(list(self._tail)[-lines:]) or "(no output)"

    def stop(self, grace_s: float = _STOP_GRACE_S) -> int | None:
        """SIGTERM the process's group, SIGKILL what is left after ``grace_s``; its exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(proc.pid, signal.SIGKILL)  # also children that outlived their session leader
        return proc.wait()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class _Running:
    proc: Process
    name: str
    slot: Any
    log_path: str
    node_ip: str
    reported: bool = False


def check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """A clear sentence instead of Ray's long retries when nothing listens at ``address``."""
    if not address or address == "auto" or address.startswith("ray://"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(
            f"--address {address!r} is not host:port (the head node's address that `ray start --head` "
            "printed, e.g. 10.0.0.1:6379)"
        )
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterError(
            f"cannot reach the Ray cluster at {address} ({exc.strerror or exc}); start it with `ray "
            "start --head` on the head node and pass the address it prints, or leave --address out to "
            "start a local Ray instance"
        ) from None


class RayLaunch:
    """One run on a Ray cluster (see the module docstring); ``run()`` returns the exit status."""

    def __init__(
        self,
        cfg: Config,
        plan: ClusterPlan,
        config: str | None,
        overrides: Sequence[str],
        job: Job = "rl",
        cpus_per_gpu: float = 1.0,
        placement_timeout: float = 120.0,
    ):
        self.ray = _import_ray()
        self.cfg = cfg
        self.plan = plan
        self.args = run_args(config, overrides)
        self.job: Job = job
        self.cpus_per_gpu = cpus_per_gpu
        self.placement_timeout = placement_timeout
        self.run_dir = cfg.run_dir.absolute()
        self.namespace = self.ray.get_runtime_context().namespace
        self.address = self.ray.get_runtime_context().gcs_address
        self.groups: dict[int, Any] = {}
        # Slot actors by (plan node, GPU, role of the process it holds the GPU for).
        self.slots: dict[tuple[int, int, str], Any] = {}
        self.where: dict[tuple[int, int, str], dict[str, Any]] = {}
        self.running: list[_Running] = []
        self.directory: Any = None
        self.report: list[dict[str, Any]] = []
        self.with_servers = job == "rl" and not cfg.rollout.server_addrs and bool(plan.servers)

    # ------------------------------------------------------------------ placing
    def _node_procs(self, node: int) -> tuple[Process, ...]:
        return self.plan.on_node(node) if self.with_servers else self.plan.train_ranks_on(node)

    def _node_gpus(self, node: int) -> list[int]:
        return sorted({g for p in self._node_procs(node) for g in p.gpus})

    def _roles_on(self, node: int, gpu: int) -> list[str]:
        """Roles of the processes on ``gpu`` of ``node``: one, or a server's and a training rank's when colocated."""
        return sorted({p.role for p in self._node_procs(node) if gpu in p.gpus})

    def assign_nodes(self) -> dict[int, dict[str, Any]]:
        """Plan node -> a distinct alive Ray node with at least the GPUs the plan uses there."""
        ray_nodes = sorted(
            (n for n in self.ray.nodes() if n.get("Alive")), key=lambda n: (n["NodeManagerAddress"], n["NodeID"])
        )
        wanted = {n: len(self._node_gpus(n)) for n in range(self.plan.n_nodes) if self._node_gpus(n)}
        free = list(ray_nodes)
        assigned: dict[int, dict[str, Any]] = {}
        for node in sorted(wanted, key=lambda n: -wanted[n]):
            match = next((r for r in free if r["Resources"].get("GPU", 0) >= wanted[node]), None)
            if match is None:
                have = (
                    ", ".join(f"{r['NodeManagerAddress']} ({r['Resources'].get('GPU', 0):g} GPUs)" for r in ray_nodes)
                    or "none"
                )
                raise ClusterError(
                    f"the plan needs {len(wanted)} node(s) with {', '.join(map(str, sorted(wanted.values())))} GPUs "
                    f"(cluster.n_nodes = {self.plan.n_nodes} x cluster.n_gpus_per_node = "
                    f"{self.plan.n_gpus_per_node}), but the Ray cluster at {self.address} has nodes: {have}; add Ray "
                    "nodes with GPUs, or make cluster.n_nodes and cluster.n_gpus_per_node describe this cluster"
                )
            free.remove(match)
            assigned[node] = match
        return dict(sorted(assigned.items()))

    def place(self) -> None:
        """A placement group per plan node on its Ray node, and a slot actor per GPU."""
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        for node, ray_node in self.assign_nodes().items():
            gpus = self._node_gpus(node)
            bundle = {"GPU": 1.0, **({"CPU": self.cpus_per_gpu} if self.cpus_per_gpu else {})}
            pg = placement_group(
                [dict(bundle) for _ in gpus],
                strategy="STRICT_PACK",
                name=f"{self.namespace}-node{node}",
                bundle_label_selector=[{"ray.io/node-id": ray_node["NodeID"]} for _ in gpus],
            )
            self.groups[node] = pg
            try:
                ray.get(pg.ready(), timeout=self.placement_timeout)
            except ray.exceptions.GetTimeoutError:
                raise ClusterError(
                    f"Ray could not reserve {len(gpus)} GPU(s) and {self.cpus_per_gpu:g} CPU(s) per GPU on node "
                    f"{ray_node['NodeManagerAddress']} ({ray_node['NodeID'][:12]}) for plan node {node} within "
                    f"{self.placement_timeout:g} s; other Ray work holds them: free them, or lower --cpus-per-gpu"
                ) from None
            placed = set(placement_group_table(pg)["bundles_to_node_id"].values())
            if placed != {ray_node["NodeID"]}:
                raise ClusterError(
                    f"Ray placed plan node {node}'s bundles on {sorted(placed)}, not on the one node "
                    f"{ray_node['NodeID']}; this Ray does not honour bundle label selectors, use "
                    "Ray >= 2.50 (pip install 'archon[ray]')"
                )
            slot_cls = ray.remote(ProcessSlot)
            for i, gpu in enumerate(gpus):
                roles = self._roles_on(node, gpu)
                for role in roles:
                    self.slots[(node, gpu, role)] = slot_cls.options(
                        num_cpus=0,
                        num_gpus=1 / len(roles),  # colocated: the server and the training rank share the bundle
                        name=f"node{node}-gpu{gpu}" + (f"-{role}" if len(roles) > 1 else ""),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                    ).remote()
        keys = list(self.slots)
        self.where = dict(zip(keys, ray.get([self.slots[k].where.remote() for k in keys])))

    def _visible(self, proc: Process) -> str:
        return ",".join(g for gpu in proc.gpus for g in self.where[(proc.node, gpu, proc.role)]["gpu_ids"])

    # ------------------------------------------------------------------ starting
    def _start(self, proc: Process, name: str, argv: list[str], env: dict[str, str], echo: bool) -> None:
        key = (proc.node, proc.gpus[0], proc.role)
        log_path = str(self.run_dir / "launch" / f"{name.replace(' ', '-')}.log")
        slot = self.slots[key]
        got = self.ray.get(slot.start.remote(name, argv, env, os.getcwd(), log_path, echo))
        self.running.append(_Running(proc, name, slot, log_path, self.where[key]["ip"]))
        self.report.append(
            {
                "role": proc.role,
                "index": proc.index,
                "plan_node": proc.node,
                "plan_gpus": list(proc.gpus),
                "ray_node_id": self.where[key]["node_id"],
                "ip": self.where[key]["ip"],
                "CUDA_VISIBLE_DEVICES": got["CUDA_VISIBLE_DEVICES"],
                "pid": got["pid"],
                "log": log_path,
            }
        )

    def start(self) -> None:
        common = {"PYTHONUNBUFFERED": "1", LAUNCH_ID_ENV: self.namespace, "RAY_ADDRESS": self.address}
        if self.with_servers:
            self.directory = (
                self.ray.remote(num_cpus=0)(ServerDirectory)
                .options(name=DIRECTORY_NAME, namespace=self.namespace)
                .remote()
            )
            common.update({REGISTRY_ENV: f"ray:{self.namespace}", API_KEY_ENV: generate_api_key()})
            for s in self.plan.servers:
                visible = self._visible(s)
                argv = [
                    "python",
                    "-m",
                    "archon.launch",
                    "serve-node",
                    "--node",
                    str(s.node),
                    "--server",
                    str(s.index),
                    "--gpus",
                    visible,
                    "--host",
                    self.where[(s.node, s.gpus[0], s.role)]["ip"],
                    *self.args,
                ]
                self._start(s, f"server {s.index}", argv, {**common, "CUDA_VISIBLE_DEVICES": visible}, echo=True)
        ranks = self.plan.train_ranks
        master = (ranks[0].node, ranks[0].gpus[0], ranks[0].role)
        port = self.ray.get(self.slots[master].free_port.remote())
        train_nodes = self.plan.train_nodes
        for r in ranks:
            env = {
                **common,
                "MASTER_ADDR": self.where[master]["ip"],
                "MASTER_PORT": str(port),
                "RANK": str(r.index),
                "WORLD_SIZE": str(len(ranks)),
                "LOCAL_RANK": str(r.local_index),
                "LOCAL_WORLD_SIZE": str(len(self.plan.train_ranks_on(r.node))),
                "GROUP_RANK": str(train_nodes.index(r.node)),
                "ROLE_RANK": str(r.index),
                "ROLE_WORLD_SIZE": str(len(ranks)),
                "CUDA_VISIBLE_DEVICES": self._visible(r),
            }
            self._start(
                r, f"rank {r.index}", ["python", str(entry_point(self.job)), *self.args], env, echo=r.index == 0
            )
        path = self.run_dir / "launch" / "ray_placement.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.report, indent=1))
        for row in self.report:
            logger.info(
                "%s %d: plan node %d GPUs %s -> Ray node %s (%s), CUDA_VISIBLE_DEVICES=%s, log %s",
                row["role"],
                row["index"],
                row["plan_node"],
                row["plan_gpus"],
                row["ray_node_id"][:12],
                row["ip"],
                row["CUDA_VISIBLE_DEVICES"],
                row["log"],
            )

    # ------------------------------------------------------------------ watching
    def _poll(self) -> list[int | None]:
        try:
            return self.ray.get([r.slot.poll.remote() for r in self.running])
        except self.ray.exceptions.RayActorError as exc:
            raise LaunchError(f"Ray lost a process slot of this run (its node died or was removed): {exc}") from None

    def watch(self) -> int:
        """Until every training rank has exited: 0 when all succeeded, else ``LaunchError`` naming the failure."""
        ray = self.ray
        while True:
            codes = self._poll()
            for run, code in zip(self.running, codes):
                if run.proc.role == "rollout" and code is not None and not run.reported:
                    run.reported = True
                    logger.error(
                        "%s (plan node %d, %s) exited with code %s; last lines of %s:\n%s",
                        run.name,
                        run.proc.node,
                        run.node_ip,
                        code,
                        run.log_path,
                        ray.get(run.slot.tail.remote()),
                    )
            ranks = [(r, c) for r, c in zip(self.running, codes) if r.proc.role == "train"]
            if any(c not in (None, 0) for _, c in ranks):
                raise self._failure()
            if all(c == 0 for _, c in ranks):
                logger.info("training finished on all %d rank(s)", len(ranks))
                return 0
            time.sleep(_POLL_S)

    def _failure(self) -> LaunchError:
        """The error of a failed run: the rank that printed the job's one-line reason, with its log's last lines."""
        deadline = time.monotonic() + _FAILURE_GRACE_S
        while True:  # ranks that fail together print their shared reason once, on one rank: let them all exit
            ranks = [(r, c) for r, c in zip(self.running, self._poll()) if r.proc.role == "train"]
            if all(c is not None for _, c in ranks) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        failed = [(r, c, self.ray.get(r.slot.tail.remote())) for r, c in ranks if c not in (None, 0)]
        run, code, tail = next((f for f in failed if "\nerror: " in f"\n{f[2]}"), failed[0])
        return LaunchError(
            f"training {run.name} (plan node {run.proc.node}, {run.node_ip}) exited with code {code}; "
            f"last lines of {run.log_path}:\n{tail}"
        )

    def stop(self) -> None:
        """Stop every process, then the slots, the directory and the placement groups (idempotent)."""
        ray = self.ray
        running, self.running = self.running, []
        if running:
            try:
                ray.get([r.slot.stop.remote() for r in running], timeout=_STOP_GRACE_S * 3)
            except Exception as exc:  # noqa: BLE001 - a dead slot's children got SIGTERM from their dying parent
                logger.warning("stopping the run's processes: %s", exc)
        for actor in [*self.slots.values(), *([self.directory] if self.directory is not None else [])]:
            ray.kill(actor)
        self.slots, self.directory = {}, None
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            remove_placement_group(pg)
        self.groups = {}

    def run(self) -> int:
        try:
            self.place()
            self.start()
            return self.watch()
        finally:
            self.stop()


def launch_ray(
    cfg: Config,
    plan: ClusterPlan,
    config: str | None,
    overrides: Sequence[str],
    job: Job = "rl",
    address: str | None = None,
    cpus_per_gpu: float = 1.0,
    placement_timeout: float = 120.0,
) -> int:
    """Connect to the Ray cluster at ``address`` (None: start a local one) and run there; the exit status."""
    ray = _import_ray()
    check_reachable(address)
    namespace = f"archon-{uuid.uuid4().hex[:12]}"
    kwargs: dict[str, Any] = {"namespace": namespace, "log_to_driver": True}
    if address:
        kwargs["address"] = address
    elif cfg.device == "cpu":
        # A local instance for a CPU run: the plan's 'GPUs' are process slots, declared as logical GPUs.
        kwargs["num_gpus"] = plan.n_gpus_per_node
        kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(plan.n_gpus_per_node * cpus_per_gpu))
    try:
        ray.init(**kwargs)
    except ConnectionError as exc:
        raise ClusterError(f"cannot connect to the Ray cluster at {address}: {exc}") from None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (e.g. from a job scheduler) stops the run like Ctrl-C

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        return RayLaunch(cfg, plan, config, overrides, job, cpus_per_gpu, placement_timeout).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        ray.shutdown()
