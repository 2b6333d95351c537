"""Starting and stopping rollout servers on this node.

``build_launch_specs(cfg)`` turns the rollout allocation into one command line and
environment per server: ``sglang:dNtM`` gives N ``python -m sglang.launch_server`` processes of
M GPUs each, ``vllm:dNtMpK`` N ``vllm serve`` processes of M*K GPUs each (``archon.rollout.vllm``),
with ``CUDA_VISIBLE_DEVICES`` = the GPUs the cluster plan (``archon.plan``) gives each server;
``local:dN`` gives N built-in CPU servers (``python -m archon.server.app``).
The ``[sglang]`` options only shape a server's internals (DP attention, expert parallel, ...);
they never change how many GPUs a server gets, so they are checked against its tp size.
A context length is passed only when the user sets one (``sglang.context_length``,
``vllm.max_model_len``), clamped to the model's own: both servers refuse to start above it.

``RolloutLauncher`` starts the specs, each in its own session (so stopping reaches the
server's own children), logs to ``<run_dir>/rollout/server_<i>.log``, waits for ``/health``,
and stops every server however the trainer ends: context-manager exit, an exception during
startup, ``atexit``, SIGINT or SIGTERM.  With ``rollout.server_addrs`` set nothing is
launched and those addresses are used as they are.

``build_launch_specs(cfg, node=n)`` gives the servers the plan puts on node ``n`` (what a
cluster launcher starts there).  Without ``node`` the trainer launches them itself, on the node
of training rank 0; a server the plan puts on another node is then an error asking for a
cluster launcher or ``rollout.server_addrs``.

Every launched server gets the run's API key (``archon.wire.auth``): the built-in one in
its environment, SGLang as ``--api-key`` (redacted in the log), vLLM as ``VLLM_API_KEY``;
``RolloutLauncher.api_key`` hands it to the client, and ``<run_dir>/rollout/api_key`` holds it
while the servers run (a cluster launcher writes that file once for the whole run, and its
serve-node steps pass ``write_key_file=False``; ``archon.launch.discovery``).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from archon.alloc import AllocationError, ModelAllocation
from archon.config import Config, ConfigError
from archon.config.vllm_checks import check_vllm_config
from archon.errors import ArchonError
from archon.launch.server_commands import (
    check_sglang_options,
    local_command,
    local_server_device,
    resolve_context_length,
    sglang_command,
    vllm_command,
    vllm_env,
    vllm_model_view,
)
from archon.plan import IN_PROCESS_BACKEND, ClusterPlan, Process, plan_for_config
from archon.rollout.server_api import HEALTH_PROBE_TIMEOUT_S
from archon.rollout.tied_embeddings import untied_view
from archon.runtime.cpu_pinning import share_of_slots
from archon.wire.auth import API_KEY_ENV, generate_api_key, write_api_key
from models.common.linear import CPU_LINEAR_ENV, cpu_linear_kernel

logger = logging.getLogger("archon.launch.servers")

_LOG_TAIL_LINES = 40
_PORT_CLASH_RETRIES = 3


class RolloutLaunchError(ArchonError, RuntimeError):
    """A rollout server could not be started or did not become healthy; the message says which and why."""


@dataclass
class LaunchSpec:
    """How to start one rollout server."""

    index: int
    """Server number (0..d-1)."""
    cmd: list[str]
    """Command line."""
    env: dict[str, str]
    """Variables set on top of the launcher's environment, less torchrun's (e.g. CUDA_VISIBLE_DEVICES)."""
    host: str
    """Address the server binds to."""
    port: int
    """Port the server listens on."""
    log_path: Path
    """File that receives the server's stdout and stderr."""
    connect_host: str = ""
    """Address clients use to reach it; empty means `host` (or 127.0.0.1 when binding 0.0.0.0)."""
    api_key: str | None = None
    """Key the server requires (``Authorization: Bearer``); None: an open server."""
    model_view: tuple[str, str] | None = None
    """(model folder, view folder): make the untied view the command names before launching (vLLM, tied embeddings)."""

    @property
    def addr(self) -> str:
        """host:port for RolloutClient."""
        host = self.connect_host or ("127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host)
        return f"{host}:{self.port}"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that are free right now (all sockets stay open until every port is picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host if host not in ("", "::") else "0.0.0.0", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# What torchrun sets in a training rank's environment.  A server launched by rank 0 must not inherit them: SGLang's and
# vLLM's own init_process_group would read RANK / WORLD_SIZE / MASTER_* and, with TORCHELASTIC_USE_AGENT_STORE, join
# torchrun's agent store as a client (torch's rendezvous._create_c10d_store) and wait for a server that never answers.
_TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def server_environment(extra: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """A launched server's environment: ``base`` (this process's) without torchrun's variables, plus ``extra``."""
    base = dict(os.environ if base is None else base)
    clean = {k: v for k, v in base.items() if k not in _TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    return {**clean, **extra}


def visible_devices(gpus: Sequence[int], who: str, inherited: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for node-local plan GPUs ``gpus``: mapped through the list this process was given.

    A job that holds part of a node (Slurm's ``--gres``, a container) sees its GPUs renumbered from 0 with
    ``CUDA_VISIBLE_DEVICES`` naming the real ones; a child process reads that variable against the whole node, so
    plan GPU ``g`` is the ``g``-th entry of the inherited list, not device ``g``.
    """
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES") if inherited is None else inherited
    if not inherited or not inherited.strip():
        return ",".join(map(str, gpus))
    listed = [d.strip() for d in inherited.split(",") if d.strip()]
    beyond = [g for g in gpus if g >= len(listed)]
    if beyond:
        raise ConfigError(
            f"the cluster plan puts {who} on GPU(s) {','.join(map(str, gpus))} of its node, but this process sees only "
            f"{len(listed)} (CUDA_VISIBLE_DEVICES={inherited}); set cluster.n_gpus_per_node = {len(listed)} or give "
            "the job the GPUs the plan needs (`python -m archon.plan` shows the layout)"
        )
    return ",".join(listed[g] for g in gpus)


def _server_model_path(cfg: Config, backend: str) -> str:
    key = "vllm.model" if backend == "vllm" else "sglang.model_path"
    path = (cfg.vllm.model if backend == "vllm" else cfg.sglang.model_path) or cfg.actor.path
    if not path:
        raise ConfigError(
            f"rollout servers need a model to start from: set {key} or actor.path to a "
            "Hugging Face folder (or pass rollout.server_addrs of servers you started)"
        )
    return path


def _servers_of_node(rollout: ModelAllocation, plan: ClusterPlan, node: int | None) -> tuple[Process, ...]:
    """The servers to launch: those of ``node``, or (None) all of them, which must be on training rank 0's node."""
    if node is not None:
        if not 0 <= node < plan.n_nodes:
            raise ConfigError(f"node {node} is not in the cluster (cluster.n_nodes = {plan.n_nodes})")
        return plan.servers_on(node)
    here = plan.train_ranks[0].node if plan.train_ranks else 0
    remote = [s for s in plan.servers if s.node != here]
    if remote:
        where = ", ".join(f"server {s.index} on node {s.node} (GPUs {','.join(map(str, s.gpus))})" for s in remote)
        raise ConfigError(
            f"rollout.backend = '{rollout}' places {where}, but the trainer launches servers only on "
            f"its own node {here} (that of training rank 0); start the run with a cluster launcher "
            "that starts every node's servers (`python -m archon.launch slurm|ray`), or start them "
            "yourself and list every server's host:port in rollout.server_addrs (`python -m archon.plan` "
            "shows the layout)"
        )
    return plan.servers


def build_launch_specs(
    cfg: Config,
    run_dir: str | Path | None = None,
    *,
    host: str | None = None,
    ports: Sequence[int] | None = None,
    node: int | None = None,
    api_key: str | None = None,
    map_visible_devices: bool = True,
) -> list[LaunchSpec]:
    """One LaunchSpec per rollout server of ``cfg.rollout.backend`` (empty when server_addrs is set).

    ``node``: only the servers the cluster plan puts on that node; None: every server, which
    must then be on the node of training rank 0 (the trainer launches them).  Every server
    requires ``api_key`` (default: a fresh key for this run).  A server's plan GPUs are mapped
    through this process's ``CUDA_VISIBLE_DEVICES`` (``visible_devices``) unless
    ``map_visible_devices`` is false (the caller sets each server's devices itself).
    """
    rollout = cfg.allocations()["rollout"]
    if cfg.rollout.server_addrs or rollout.backend == IN_PROCESS_BACKEND:
        return []
    try:
        plan = plan_for_config(cfg)
    except AllocationError as exc:
        raise ConfigError(str(exc)) from None
    tp, pp = rollout.parallel.tp_size, rollout.parallel.pp_size
    if rollout.backend == "sglang":
        check_sglang_options(cfg.sglang, tp, str(rollout))
    servers = _servers_of_node(rollout, plan, node)
    model_path = _server_model_path(cfg, rollout.backend)
    # One node: loopback suffices; with several nodes trainer ranks elsewhere must reach the servers.
    bind = host or ("127.0.0.1" if cfg.cluster.n_nodes == 1 else "0.0.0.0")
    connect = "" if bind not in ("0.0.0.0", "::") or cfg.cluster.n_nodes == 1 else socket.gethostname()
    ports = list(ports) if ports is not None else free_ports(len(servers), bind)
    if len(ports) != len(servers):
        raise ValueError(f"{len(ports)} ports given for {len(servers)} rollout servers")
    log_dir = Path(run_dir if run_dir is not None else cfg.run_dir) / "rollout"
    model_view = None
    if rollout.backend == "vllm":
        check_vllm_config(cfg)
        context = resolve_context_length(cfg.vllm.max_model_len, model_path, "vllm.max_model_len")
        view = vllm_model_view(model_path, log_dir.parent)
        if view is not None:
            model_view, model_path = (model_path, str(view)), str(view)
    else:
        context = resolve_context_length(cfg.sglang.context_length, model_path, "sglang.context_length")
    api_key = api_key or generate_api_key()
    specs = []
    for placement, port in zip(servers, ports):
        env = {"PYTHONUNBUFFERED": "1"}
        # The built-in server's plan slots are CPU slots (it gets no GPU) unless it shares a training rank's GPU.
        inherited = None if map_visible_devices else ""
        who = f"rollout server {placement.index}"
        on_gpu = rollout.backend != "local" or local_server_device(cfg) == "cuda"
        gpus = visible_devices(placement.gpus, who, inherited) if on_gpu else ""
        if rollout.backend == "sglang":
            cmd = sglang_command(
                cfg, model_path, bind, port, cfg.sglang.random_seed + placement.index, tp, context, api_key
            )
            env["CUDA_VISIBLE_DEVICES"] = gpus
        elif rollout.backend == "vllm":
            cmd = vllm_command(cfg, model_path, bind, port, cfg.vllm.seed + placement.index, tp, pp, context)
            env.update(vllm_env(cfg), CUDA_VISIBLE_DEVICES=gpus, VLLM_API_KEY=api_key)
        else:
            cmd = local_command(cfg, model_path, bind, port, cfg.sglang.random_seed + placement.index, context)
            cmd += _cpu_cores_args(cfg, placement.gpus, placement.index)
            env["CUDA_VISIBLE_DEVICES"] = gpus  # empty: a CPU process
            env[API_KEY_ENV] = api_key
        specs.append(
            LaunchSpec(
                placement.index,
                cmd,
                env,
                bind,
                port,
                log_dir / f"server_{placement.index}.log",
                connect,
                api_key,
                model_view,
            )
        )
    return specs


def _cpu_cores_args(cfg: Config, slots: Sequence[int], index: int) -> list[str]:
    """``--cpu-cores`` for a built-in server under ``cluster.pin_cpu_cores``: its slots' share of the cores."""
    if not cfg.cluster.pin_cpu_cores:
        return []
    cores = share_of_slots(slots, cfg.cluster.n_gpus_per_node, f"rollout server {index}")
    return [] if cores is None else ["--cpu-cores", ",".join(map(str, cores))]


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


# Local health checks must not go through an HTTP proxy from the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(addr: str, timeout: float = HEALTH_PROBE_TIMEOUT_S) -> bool:
    # SGLang's /health is a one-token generation: about a second, more on a busy server.
    try:
        with _NO_PROXY_OPENER.open(f"http://{addr}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class _Running:
    spec: LaunchSpec
    proc: subprocess.Popen
    log: Any = field(repr=False)


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launching thread dies, even by SIGKILL.

    atexit and signal handlers cannot run when the trainer is killed hard (OOM killer,
    ``kill -9``); without this the servers would outlive it and hold their GPUs and ports.
    Linux only; elsewhere the other cleanup paths remain.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class RolloutLauncher:
    """Starts rollout servers, waits until they are healthy, and always stops them."""

    def __init__(
        self,
        specs: Sequence[LaunchSpec],
        *,
        setup_timeout: float = 300.0,
        stop_grace_s: float = 10.0,
        server_addrs: Sequence[str] = (),
        write_key_file: bool = True,
    ):
        if specs and server_addrs:
            raise ValueError("give RolloutLauncher either launch specs or existing server_addrs, not both")
        self.specs = list(specs)
        self.setup_timeout = setup_timeout
        self.stop_grace_s = stop_grace_s
        self._external = list(server_addrs)
        # A cluster launcher's serve-node runs beside others that share the run's key file: not its to write.
        self._write_key_file = write_key_file
        self._running: list[_Running] = []
        self._prev_handlers: dict[int, Any] = {}
        self._atexit_registered = False
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Config, run_dir: str | Path | None = None, **kwargs: Any) -> RolloutLauncher:
        if cfg.rollout.server_addrs:
            return cls([], setup_timeout=cfg.rollout.setup_timeout, server_addrs=cfg.rollout.server_addrs, **kwargs)
        return cls(build_launch_specs(cfg, run_dir), setup_timeout=cfg.rollout.setup_timeout, **kwargs)

    @property
    def addrs(self) -> list[str]:
        """host:port of every server (launched or given)."""
        return list(self._external) if self._external else [s.addr for s in self.specs]

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._running]

    @property
    def api_key(self) -> str | None:
        """The key the launched servers require (None when nothing is launched)."""
        return self.specs[0].api_key if self.specs else None

    @property
    def key_path(self) -> Path | None:
        """``<run_dir>/rollout/api_key`` while the servers run."""
        if not (self.specs and self.api_key and self._write_key_file):
            return None
        return self.specs[0].log_path.parent / "api_key"

    def start(self) -> list[str]:
        """Launch every server and wait for /health; on any failure stop them all and raise."""
        if not self.specs:
            return self.addrs
        if self._running:
            raise RuntimeError("RolloutLauncher.start() called twice; stop() first")
        self._install_handlers()
        try:
            if self.key_path is not None and self.api_key is not None:  # a key path implies a key
                write_api_key(self.key_path, self.api_key)
            for spec in self.specs:
                self._launch(spec)
            self._wait_healthy(self._running, new_port_on_clash=True)
        except BaseException:
            self.stop()
            raise
        logger.info("rollout servers up: %s", ", ".join(self.addrs))
        return self.addrs

    def exited(self) -> dict[int, int]:
        """Exit code of every launched server whose process has ended, by server index."""
        return {r.spec.index: r.proc.returncode for r in self._running if r.proc.poll() is not None}

    def log_path(self, index: int) -> Path:
        """Where server ``index`` logs."""
        return self._spec(index).log_path

    def log_tail(self, index: int, lines: int = 10) -> str:
        """The last ``lines`` lines of server ``index``'s log."""
        return _tail(self._spec(index).log_path, lines)

    def _spec(self, index: int) -> LaunchSpec:
        return next(s for s in self.specs if s.index == index)

    def restart(self, index: int) -> str:
        """Stop server ``index`` if it still runs, start it again on its port, wait for /health; its address.

        It starts from the model folder: the caller must give it the current weights before it serves.
        """
        with self._lock:
            pos = next((i for i, r in enumerate(self._running) if r.spec.index == index), None)
            if pos is None:
                raise RuntimeError(f"rollout server {index} was not started by this launcher (or it was stopped)")
            old = self._running.pop(pos)
        _terminate([old], self.stop_grace_s)
        spec = self._spec(index)
        self._launch(spec)
        self._wait_healthy([r for r in self._running if r.spec.index == index])
        logger.info("restarted rollout server %d on %s", index, spec.addr)
        return spec.addr

    def _launch(self, spec: LaunchSpec) -> None:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(spec.log_path, "ab")
        shown = ["<api key>" if spec.api_key and arg == spec.api_key else arg for arg in spec.cmd]
        log.write(f"# {' '.join(shown)}\n".encode())
        log.flush()
        if spec.model_view is not None:
            untied_view(*spec.model_view)
            logger.info("%s ties its word embeddings: serving an untied view, %s", *spec.model_view)
        # Built-in servers compute float32 CPU linears with this process's kernel: the trainer's numerics.
        env = server_environment({CPU_LINEAR_ENV: cpu_linear_kernel(), **spec.env})
        try:
            # A session of its own: stop() signals the whole group, SGLang's scheduler children included,
            # and a Ctrl-C in the terminal reaches the trainer only (which then stops the servers).
            proc = subprocess.Popen(
                spec.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            log.close()
            raise RolloutLaunchError(f"could not start rollout server {spec.index} ({spec.cmd[0]}): {exc}") from None
        self._running.append(_Running(spec, proc, log))
        logger.info("started rollout server %d (pid %d) on %s, log %s", spec.index, proc.pid, spec.addr, spec.log_path)

    def _wait_healthy(self, runs: list[_Running], new_port_on_clash: bool = False) -> None:
        """Wait until every run answers /health.

        ``new_port_on_clash``: a server that could not bind its port (free when picked, taken since
        by another process: a port can only be chosen before the server binds it) starts again on
        another one, a few times at most.  Not for a restart, whose address the clients know.
        """
        deadline = time.monotonic() + self.setup_timeout
        pending = list(runs)
        clashes = 0
        delay = 0.1
        while pending:
            for run in list(pending):
                code = run.proc.poll()
                if code is not None and new_port_on_clash and clashes < _PORT_CLASH_RETRIES and _port_clash(run):
                    clashes += 1
                    pending[pending.index(run)] = self._relaunch_on_new_port(run)
                    continue
                if code is not None:
                    raise RolloutLaunchError(
                        f"rollout server {run.spec.index} ({run.spec.addr}) exited with code {code} during startup; "
                        f"last lines of {run.spec.log_path}:\n{_tail(run.spec.log_path)}"
                    )
                if _healthy(run.spec.addr, min(HEALTH_PROBE_TIMEOUT_S, max(deadline - time.monotonic(), 0.5))):
                    pending.remove(run)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{r.spec.index} ({r.spec.addr})" for r in pending)
                last = pending[0].spec.log_path
                raise RolloutLaunchError(
                    f"rollout server(s) {names} not healthy after {self.setup_timeout:g} s; raise "
                    f"rollout.setup_timeout if the model is large; last lines of {last}:\n{_tail(last)}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def _relaunch_on_new_port(self, run: _Running) -> _Running:
        old = run.spec
        port = free_ports(1, old.host)[0]
        cmd = list(old.cmd)
        cmd[cmd.index("--port") + 1] = str(port)
        spec = dataclasses.replace(old, cmd=cmd, port=port)
        logger.warning(
            "rollout server %d could not bind %s (taken meanwhile); starting it on port %d", old.index, old.addr, port
        )
        run.log.close()
        self._running.remove(run)
        self.specs[self.specs.index(old)] = spec
        self._launch(spec)
        return self._running[-1]

    def stop(self) -> None:
        """Terminate every server's process group, kill what is left after the grace period (idempotent)."""
        with self._lock:
            running, self._running = self._running, []
        self._restore_handlers()
        if self.key_path is not None:
            self.key_path.unlink(missing_ok=True)
        if not running:
            return
        _terminate(running, self.stop_grace_s)
        logger.info("stopped %d rollout server(s)", len(running))

    # ------------------------------------------------------------------ cleanup hooks
    def _install_handlers(self) -> None:
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still covers us
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(sig)
            if prev is signal.SIG_IGN:
                continue  # e.g. started under nohup: keep ignoring it
            self._prev_handlers[sig] = prev
            signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False
        if threading.current_thread() is not threading.main_thread():
            return
        prev, self._prev_handlers = self._prev_handlers, {}
        for sig, handler in prev.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        logger.warning("received %s: stopping rollout servers", signal.Signals(signum).name)
        self.stop()
        if callable(prev):
            prev(signum, frame)  # e.g. Python's default SIGINT handler raises KeyboardInterrupt
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            # The previous disposition was the default (terminate): die of the same signal.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def __enter__(self) -> RolloutLauncher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_clash(run: _Running) -> bool:
    """Whether the server exited because its port was taken (uvicorn, SGLang and vLLM all log errno 98)."""
    return "address already in use" in _tail(run.spec.log_path).lower()


def _terminate(running: list[_Running], grace_s: float) -> None:
    """SIGTERM each server's process group, SIGKILL what is left after ``grace_s``, close the logs."""
    for run in running:
        _signal_group(run.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for run in running:
        try:
            run.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning(
                "rollout server %d (pid %d) ignored SIGTERM for %g s; killing it", run.spec.index, run.proc.pid, grace_s
            )
    for run in running:
        # Also reaches children that outlived their session leader.
        _signal_group(run.proc, signal.SIGKILL)
        run.proc.wait()
        run.log.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session made the server the leader of group proc.pid
    except (ProcessLookupError, PermissionError):
        pass
