"""A real one-node Slurm on this machine for tests: Debian's ``slurm-wlm`` and ``munge``.

``start_cluster(new_root())`` installs the packages with apt-get when they are missing (root only;
once installed they stay for the machine's life), then starts, all under ``root`` and on ports
of its own so that nothing collides with another session or a Slurm already running here:

* ``munged`` with a private key and socket;
* ``slurmctld`` and ``slurmd`` (as root) with a private ``slurm.conf``: one node named after
  this host with all its CPUs and ``gpus`` GPUs declared as generic resources (``gres.conf``
  points at character devices made here, AutoDetect off, so Slurm itself sets
  ``CUDA_VISIBLE_DEVICES`` in the steps of a job that asks for GPUs), one partition.

No cgroup plugin (a container's cgroups are seldom writable): ``proctrack/pgid`` follows a
step's processes by process group, so a process that leaves the group (a new session) is only
stopped if Archon stops it; ``task/none`` binds nothing.

Whatever cannot be installed or started raises ``SlurmUnavailable`` with one sentence of why
(the test fixture turns it into a skip).  ``SlurmCluster.stop()`` cancels what is left and
stops the daemons; a cluster left running by a session that died is stopped by the next one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dist_utils import find_free_port, pid_alive

PACKAGES = ("slurm-wlm", "munge")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
END_STATES = frozenset(
    {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
)
DAEMONS = ("slurmd", "slurmctld", "munged")  # stopped in this order
_CLUSTERS = Path(tempfile.gettempdir()) / "archon-real-slurm"


class SlurmUnavailable(RuntimeError):
    """A real Slurm cannot be installed or started here; the message says why."""


@dataclass
class SlurmCluster:
    """A running one-node cluster; its client commands find it through ``SLURM_CONF``."""

    root: Path
    node: str
    cpus: int
    gpus: int
    env: dict[str, str] = field(default_factory=dict)
    """``SLURM_CONF`` (for clients run by the tests, and the jobs they submit)."""
    install_s: float = 0.0
    """Seconds apt-get took to install the packages (0 when they were there)."""

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """A client command (``sinfo``, ``scontrol`` ...) against this cluster."""
        done = subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s KEY=VALUE fields of ``job_id`` (kept MinJobAge seconds after its end)."""
        line = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(word.split("=", 1) for word in line.split() if "=" in word)

    def wait_for_end(self, job_id: str, timeout: float = 300.0) -> dict[str, str]:
        """The job's fields once Slurm reports an end state (every step cleaned up: not COMPLETING)."""
        deadline = time.monotonic() + timeout
        while (fields := self.job_fields(job_id))["JobState"] not in END_STATES:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {fields['JobState']} after {timeout:g} s")
            time.sleep(0.2)
        return fields

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of both daemons' logs, for a failure message."""
        out = []
        for name in ("slurmctld", "slurmd"):
            path = self.root / "log" / f"{name}.log"
            if path.is_file():
                out += [f"--- {path}", *path.read_text(errors="replace").splitlines()[-lines:]]
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel the jobs still known, stop the daemons."""
        if self.conf.is_file() and self.run("scancel", "--user=root", check=False).returncode == 0:
            deadline = time.monotonic() + 60
            while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        _stop_daemons(self.root)


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stop_daemons(root: Path, timeout: float = 30.0) -> None:
    """SIGTERM to each daemon whose pid file is in ``root`` and whose command line names ``root``; then SIGKILL."""
    for name in DAEMONS:
        pid = _pid(root / "run" / f"{name}.pid")
        if pid is None or not pid_alive(pid):
            continue
        try:
            if str(root).encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue  # the pid was reused by another process
            os.kill(pid, signal.SIGTERM)
        except (OSError, ProcessLookupError):
            continue
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def _stop_stale_clusters() -> None:
    """Stop the clusters of earlier sessions that died without stopping them."""
    if not _CLUSTERS.is_dir():
        return
    for root in _CLUSTERS.iterdir():
        owner = root.name.split("-")[1] if root.name.count("-") >= 2 else ""
        if owner.isdigit() and pid_alive(int(owner)):
            continue  # a session still running its tests
        _stop_daemons(root, timeout=10)
        shutil.rmtree(root, ignore_errors=True)


def _which(command: str) -> str | None:
    """``command``'s path; the daemons are in sbin, which a non-login PATH may lack."""
    return shutil.which(command, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def _missing() -> list[str]:
    return [c for c in COMMANDS if _which(c) is None]


def ensure_installed(timeout: float = 600.0) -> float:
    """Install the packages with apt-get unless every command is there; the seconds it took (0 when there)."""
    if not _missing():
        return 0.0
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"Slurm is not installed ({', '.join(_missing())} missing) and cannot be installed without root "
            f"and apt-get; install {' '.join(PACKAGES)}"
        )
    start = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=300"]  # another apt-get of this machine may hold the lock for a while
    install = ["apt-get", *lock, "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", *lock, "update", "-q"], env=env, capture_output=True, timeout=timeout)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise SlurmUnavailable(f"`{' '.join(install)}` failed: {last[0]}")
    if _missing():
        raise SlurmUnavailable(f"{' '.join(PACKAGES)} installed, but {', '.join(_missing())} not found")
    return time.monotonic() - start


def _write_config(root: Path, node: str, cpus: int, gpus: int) -> None:
    for sub in ("run", "log", "state", "spool", "dev"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    ctld_port, slurmd_port = find_free_port(), find_free_port()
    gres = f" Gres=gpu:{gpus}" if gpus else ""
    lines = [
        f"ClusterName=archon{os.getpid()}",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'run' / 'munge.socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "GresTypes=gpu",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus}{gres} State=UNKNOWN",
        f"PartitionName=main Nodes={node} Default=YES MaxTime=INFINITE State=UP",
    ]
    (root / "slurm.conf").write_text("\n".join(lines) + "\n")
    gres_lines = ["AutoDetect=off"]
    if gpus:
        gres_lines.append(f"NodeName={node} Name=gpu File={root / 'dev'}/nvidia[0-{gpus - 1}]")
    (root / "gres.conf").write_text("\n".join(gres_lines) + "\n")


def _make_gpu_devices(root: Path, gpus: int) -> None:
    """Character devices for the GPUs (NVIDIA's major number): Slurm ignores a gres ``File`` that is no device."""
    for i in range(gpus):
        path = root / "dev" / f"nvidia{i}"
        if not path.exists():
            try:
                os.mknod(path, 0o600 | 0o020000, os.makedev(195, i))  # S_IFCHR
            except OSError as exc:
                raise SlurmUnavailable(f"cannot make the GPU device file {path} for gres.conf: {exc}") from None


def _start_munge(root: Path) -> None:
    key_dir = root / "munge"
    key_dir.mkdir(mode=0o700, exist_ok=True)
    key = key_dir / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
    # munged checks that every user can reach its socket's folder.
    root.chmod(0o755)
    (root / "run").chmod(0o755)
    _start(
        root,
        "munged",
        [
            f"--socket={root / 'run' / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={root / 'run' / 'munged.pid'}",
            f"--log-file={root / 'log' / 'munged.log'}",
            f"--seed-file={key_dir / 'munged.seed'}",
        ],
    )


def _start(root: Path, daemon: str, args: list[str]) -> None:
    """Start a daemon that forks into the background once it is set up; its own exit status says whether it was."""
    done = subprocess.run([_which(daemon) or daemon, *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        log = root / "log" / f"{daemon}.log"
        last = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
        why = done.stderr.strip() or (last[0] if last else f"exit code {done.returncode}")
        raise SlurmUnavailable(f"{daemon} did not start: {why}")


def start_cluster(root: Path, gpus: int = 4, timeout: float = 60.0) -> SlurmCluster:
    """Install if needed, then start munged, slurmctld and slurmd under ``root``; returns once the node is idle."""
    install_s = ensure_installed()
    _stop_stale_clusters()
    node = socket.gethostname()
    try:
        socket.gethostbyname(node)
    except OSError:
        raise SlurmUnavailable(f"this host's name {node!r} does not resolve, so jobs cannot reach it") from None
    root.mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(root, node, os.cpu_count() or 1, gpus, {"SLURM_CONF": str(root / "slurm.conf")}, install_s)
    try:
        _write_config(root, node, cluster.cpus, gpus)
        _make_gpu_devices(root, gpus)
        _start_munge(root)
        _start(root, "slurmctld", ["-f", str(cluster.conf)])
        _start(root, "slurmd", ["-f", str(cluster.conf), "-N", node])
        deadline = time.monotonic() + timeout
        while (state := cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()) != "idle":
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"node {node} is {state or 'unknown'}, not idle, {timeout:g} s after start")
            time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def new_root() -> Path:
    """A fresh folder for this process's cluster, named after it (``cluster-<pid>-*``) among those of others."""
    _CLUSTERS.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"cluster-{os.getpid()}-", dir=_CLUSTERS))
