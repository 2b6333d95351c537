"""Starting and stopping rollout servers on this node.

``build_launch_specs(cfg)`` turns the rollout allocation into one command line and
environment per server: ``sglang:dNtM`` gives N ``python -m sglang.launch_server`` processes of
M GPUs each, with ``CUDA_VISIBLE_DEVICES`` from the cluster plan (rollout takes global devices
``[0, R)``); ``local:dN`` gives N built-in CPU servers (``python -m archon.rollout.server``).
The ``[sglang]`` options only shape a server's internals (DP attention, expert parallel, ...);
they never change how many GPUs a server gets, so they are checked against its tp size.

``RolloutLauncher`` starts the specs, each in its own session (so stopping reaches the
server's own children), logs to ``<run_dir>/rollout/server_<i>.log``, waits for ``/health``,
and stops every server however the trainer ends: context-manager exit, an exception during
startup, ``atexit``, SIGINT or SIGTERM.  With ``rollout.server_addrs`` set nothing is
launched and those addresses are used as they are.

Only single-node launching is implemented: a server the plan puts on another node is an
error asking the user to start it there and pass its address in ``rollout.server_addrs``.
"""

from __future__ import annotations

import atexit
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
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Sequence

from archon.alloc import ModelAllocation
from archon.config import Config, ConfigError, SGLangConfig
from archon.plan import ServerPlacement, check_cluster_fit

logger = logging.getLogger("archon.rollout.launcher")

_LOG_TAIL_LINES = 40


class RolloutLaunchError(RuntimeError):
    """A rollout server could not be started or did not become healthy; the message says which and why."""


@dataclass
class LaunchSpec:
    """How to start one rollout server."""

    index: int
    """Server number (0..d-1)."""
    cmd: list[str]
    """Command line."""
    env: dict[str, str]
    """Variables set on top of the launcher's environment (e.g. CUDA_VISIBLE_DEVICES)."""
    host: str
    """Address the server binds to."""
    port: int
    """Port the server listens on."""
    log_path: Path
    """File that receives the server's stdout and stderr."""
    connect_host: str = ""
    """Address clients use to reach it; empty means `host` (or 127.0.0.1 when binding 0.0.0.0)."""

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


def ranks_per_server(rollout: ModelAllocation) -> int:
    """Processes one server contributes to a weight-update group (SGLang: its tp size; built-in: 1)."""
    return rollout.parallel.tp_size * rollout.parallel.pp_size if rollout.backend != "local" else 1


def check_sglang_options(sg: SGLangConfig, tp_size: int, alloc: str) -> None:
    """Reject [sglang] options that SGLang would refuse or that would need more GPUs than a server gets."""
    where = f"rollout.backend = '{alloc}' gives each server {tp_size} GPU(s) (t{tp_size})"
    if sg.dp_size < 1 or sg.ep_size < 1:
        raise ConfigError(f"sglang.dp_size = {sg.dp_size} and sglang.ep_size = {sg.ep_size} must be at least 1")
    if sg.dp_size > 1 and not sg.enable_dp_attention:
        raise ConfigError(f"sglang.dp_size = {sg.dp_size} without sglang.enable_dp_attention would make SGLang start "
                          f"{sg.dp_size} replicas of {tp_size} GPUs each, more than {where}; set "
                          "sglang.enable_dp_attention = true, or raise the d of rollout.backend for more servers")
    if tp_size % sg.dp_size:
        raise ConfigError(f"sglang.dp_size = {sg.dp_size} must divide the server's tp size, but {where}; pick "
                          f"sglang.dp_size from the divisors of {tp_size}")
    if tp_size % sg.ep_size:
        raise ConfigError(f"sglang.ep_size = {sg.ep_size} must divide the server's tp size, but {where}; pick "
                          f"sglang.ep_size from the divisors of {tp_size}")
    if sg.enable_dp_attention and tp_size == 1:
        raise ConfigError(f"sglang.enable_dp_attention needs more than one GPU per server, but {where}; use "
                          "a t > 1 in rollout.backend or turn it off")


def sglang_command(cfg: Config, model_path: str, host: str, port: int, seed: int, tp_size: int) -> list[str]:
    """``python -m sglang.launch_server ...`` for one server."""
    sg = cfg.sglang
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--tp-size", str(tp_size), "--skip-tokenizer-init", "--dtype", sg.dtype,
           "--mem-fraction-static", str(sg.mem_fraction_static), "--context-length", str(sg.context_length),
           "--random-seed", str(seed), "--log-level", sg.log_level]
    if sg.dp_size > 1:
        cmd += ["--dp-size", str(sg.dp_size)]
    if sg.ep_size > 1:
        cmd += ["--ep-size", str(sg.ep_size)]
    if sg.enable_dp_attention:
        cmd += ["--enable-dp-attention"]
    if sg.disable_cuda_graph:
        cmd += ["--disable-cuda-graph"]
    if sg.max_running_requests > 0:
        cmd += ["--max-running-requests", str(sg.max_running_requests)]
    if sg.attention_backend:
        cmd += ["--attention-backend", sg.attention_backend]
    if cfg.actor.moe_routing_replay and "--enable-return-routed-experts" not in sg.extra_args:
        # Routing replay needs the experts SGLang chose for every token.
        cmd += ["--enable-return-routed-experts"]
    return cmd + list(sg.extra_args)


def local_command(cfg: Config, model_path: str, host: str, port: int, seed: int) -> list[str]:
    """``python -m archon.rollout.server ...`` for one built-in CPU server."""
    return [sys.executable, "-m", "archon.rollout.server", "--model-path", model_path, "--host", host,
            "--port", str(port), "--dtype", cfg.actor.dtype, "--random-seed", str(seed),
            "--context-length", str(cfg.sglang.context_length)]


def _server_model_path(cfg: Config) -> str:
    path = cfg.sglang.model_path or cfg.actor.path
    if not path:
        raise ConfigError("rollout servers need a model to start from: set sglang.model_path or actor.path to a "
                          "Hugging Face folder (or pass rollout.server_addrs of servers you started)")
    return path


def _check_single_node(rollout: ModelAllocation, servers: Sequence[ServerPlacement]) -> None:
    remote = [s for s in servers if s.node != 0]
    if remote:
        where = ", ".join(f"server {s.index} on node {s.node} (local devices "
                          f"{','.join(map(str, s.local_devices))})" for s in remote)
        raise ConfigError(f"rollout.backend = '{rollout}' places {where}, but Archon launches rollout servers on "
                          "this node only; start those servers on their nodes yourself and list every server's "
                          "host:port in rollout.server_addrs")


def build_launch_specs(cfg: Config, run_dir: str | Path | None = None, *, host: str | None = None,
                       ports: Sequence[int] | None = None) -> list[LaunchSpec]:
    """One LaunchSpec per rollout server of ``cfg.rollout.backend`` (empty when server_addrs is set)."""
    if cfg.rollout.server_addrs:
        return []
    allocs = cfg.allocations()
    rollout = allocs["rollout"]
    try:
        plan = check_cluster_fit(allocs, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_single_node(rollout, plan.servers)
    model_path = _server_model_path(cfg)
    # One node: loopback suffices; with several nodes trainer ranks elsewhere must reach the servers.
    bind = host or ("127.0.0.1" if cfg.cluster.n_nodes == 1 else "0.0.0.0")
    connect = "" if bind not in ("0.0.0.0", "::") or cfg.cluster.n_nodes == 1 else socket.gethostname()
    ports = list(ports) if ports is not None else free_ports(len(plan.servers), bind)
    if len(ports) != len(plan.servers):
        raise ValueError(f"{len(ports)} ports given for {len(plan.servers)} rollout servers")
    log_dir = Path(run_dir if run_dir is not None else cfg.run_dir) / "rollout"
    tp = rollout.parallel.tp_size
    if rollout.backend == "sglang":
        check_sglang_options(cfg.sglang, tp, str(rollout))
    elif rollout.backend != "local":
        raise ConfigError(f"rollout.backend = '{rollout}': Archon launches 'sglang' and 'local' servers; start "
                          f"{rollout.backend} servers yourself and pass their host:port in rollout.server_addrs")
    specs = []
    for placement, port in zip(plan.servers, ports):
        seed = cfg.sglang.random_seed + placement.index
        env = {"PYTHONUNBUFFERED": "1"}
        if rollout.backend == "sglang":
            cmd = sglang_command(cfg, model_path, bind, port, seed, tp)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, placement.local_devices))
        else:
            cmd = local_command(cfg, model_path, bind, port, seed)
            env["CUDA_VISIBLE_DEVICES"] = ""  # the built-in server is a CPU process
        specs.append(LaunchSpec(placement.index, cmd, env, bind, port,
                                log_dir / f"server_{placement.index}.log", connect))
    return specs


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


# Local health checks must not go through an HTTP proxy from the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(addr: str) -> bool:
    try:
        with _NO_PROXY_OPENER.open(f"http://{addr}/health", timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class _Running:
    spec: LaunchSpec
    proc: subprocess.Popen
    log: Any = field(repr=False)


def _die_with_parent() -> None:
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

    def __init__(self, specs: Sequence[LaunchSpec], *, setup_timeout: float = 300.0, stop_grace_s: float = 10.0,
                 server_addrs: Sequence[str] = ()):
        if specs and server_addrs:
            raise ValueError("give RolloutLauncher either launch specs or existing server_addrs, not both")
        self.specs = list(specs)
        self.setup_timeout = setup_timeout
        self.stop_grace_s = stop_grace_s
        self._external = list(server_addrs)
        self._running: list[_Running] = []
        self._prev_handlers: dict[int, Any] = {}
        self._atexit_registered = False
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Config, run_dir: str | Path | None = None, **kwargs: Any) -> "RolloutLauncher":
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

    def start(self) -> list[str]:
        """Launch every server and wait for /health; on any failure stop them all and raise."""
        if not self.specs:
            return self.addrs
        if self._running:
            raise RuntimeError("RolloutLauncher.start() called twice; stop() first")
        self._install_handlers()
        try:
            for spec in self.specs:
                self._launch(spec)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        logger.info("rollout servers up: %s", ", ".join(self.addrs))
        return self.addrs

    def _launch(self, spec: LaunchSpec) -> None:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(spec.log_path, "ab")
        log.write(f"# {' '.join(spec.cmd)}\n".encode())
        log.flush()
        env = {**os.environ, **spec.env}
        try:
            # A session of its own: stop() signals the whole group, SGLang's scheduler children included,
            # and a Ctrl-C in the terminal reaches the trainer only (which then stops the servers).
            proc = subprocess.Popen(spec.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:
            log.close()
            raise RolloutLaunchError(f"could not start rollout server {spec.index} ({spec.cmd[0]}): {exc}") from None
        self._running.append(_Running(spec, proc, log))
        logger.info("started rollout server %d (pid %d) on %s, log %s", spec.index, proc.pid, spec.addr,
                    spec.log_path)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.setup_timeout
        pending = list(self._running)
        delay = 0.1
        while pending:
            for run in list(pending):
                code = run.proc.poll()
                if code is not None:
                    raise RolloutLaunchError(
                        f"rollout server {run.spec.index} ({run.spec.addr}) exited with code {code} during startup; "
                        f"last lines of {run.spec.log_path}:\n{_tail(run.spec.log_path)}")
                if _healthy(run.spec.addr):
                    pending.remove(run)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{r.spec.index} ({r.spec.addr})" for r in pending)
                last = pending[0].spec.log_path
                raise RolloutLaunchError(
                    f"rollout server(s) {names} not healthy after {self.setup_timeout:g} s; raise "
                    f"rollout.setup_timeout if the model is large; last lines of {last}:\n{_tail(last)}")
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def stop(self) -> None:
        """Terminate every server's process group, kill what is left after the grace period (idempotent)."""
        with self._lock:
            running, self._running = self._running, []
        self._restore_handlers()
        if not running:
            return
        for run in running:
            _signal_group(run.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for run in running:
            try:
                run.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("rollout server %d (pid %d) ignored SIGTERM for %g s; killing it", run.spec.index,
                               run.proc.pid, self.stop_grace_s)
        for run in running:
            # Also reaches children that outlived their session leader.
            _signal_group(run.proc, signal.SIGKILL)
            run.proc.wait()
            run.log.close()
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

    def __enter__(self) -> "RolloutLauncher":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session made the server the leader of group proc.pid
    except (ProcessLookupError, PermissionError):
        pass
