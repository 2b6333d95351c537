"""Stand-ins for Slurm's ``srun``, ``scontrol`` and ``scancel`` that run a job's steps on this machine.

``install(bin_dir)`` writes three executables.  ``scontrol show hostnames a,b`` prints the
comma-separated hosts one per line (real Slurm also expands ``node[1-3]``; the tests name
hosts plainly).  ``srun --nodelist=a,b [options] cmd ...`` runs ``cmd`` once per listed
host, as a simulated node: each task in a process group of its own, with the variables Slurm
sets in a task (``SLURM_NODEID``, ``SLURM_PROCID``, ``SLURMD_NODENAME`` ...), killing the
others when one fails (``--kill-on-bad-exit``), and exiting with the highest task status.
Like the real srun (checked on Slurm 22.05), a SIGTERM, SIGHUP or SIGQUIT to srun kills its
tasks with SIGKILL; other signals are forwarded.  ``scancel --signal=SIG <job>`` sends SIG to
the tasks of the job's running steps (``$SLURM_JOB_ID`` of their srun), not to the batch
script, as the real one does.  Each srun call is appended as a JSON line to ``$FAKE_SRUN_LOG``.
"""

from __future__ import annotations

import sys
from pathlib import Path

SRUN = r"""
import json, os, signal, subprocess, sys, time

args = sys.argv[1:]
opts = {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
hosts = [h for h in opts.get("nodelist", os.environ.get("SLURMD_NODENAME", "localhost")).split(",") if h]
if os.environ.get("FAKE_SRUN_LOG"):
    with open(os.environ["FAKE_SRUN_LOG"], "a") as fh:
        fh.write(json.dumps({"options": opts, "hosts": hosts, "command": args}) + "\n")
procs = []

def signal_tasks(signum):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass

def on_signal(signum, frame):
    # srun's answer to SIGTERM, SIGHUP and SIGQUIT is "forcing job termination": SIGKILL to its tasks.
    signal_tasks(signal.SIGKILL if signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT) else signum)

for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, on_signal)
step = os.path.join(STEPS, os.environ.get("SLURM_JOB_ID", "0"), str(os.getpid()))
for i, host in enumerate(hosts):
    env = dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0", SLURMD_NODENAME=host,
               SLURM_STEP_NUM_NODES=str(len(hosts)), SLURM_STEP_NODELIST=",".join(hosts))
    procs.append(subprocess.Popen(args, env=env, process_group=0))
os.makedirs(os.path.dirname(step), exist_ok=True)
with open(step, "w") as fh:  # where scancel finds this step's tasks
    fh.write("\n".join(str(p.pid) for p in procs))
try:
    while any(p.poll() is None for p in procs):
        if "kill-on-bad-exit" in opts and any(p.poll() not in (None, 0) for p in procs):
            signal_tasks(signal.SIGKILL)
        time.sleep(0.05)
finally:
    os.remove(step)
codes = [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs]
sys.exit(max(codes))
"""

SCONTROL = r"""
import sys

if sys.argv[1:3] != ["show", "hostnames"]:
    sys.exit(f"fake scontrol only answers 'show hostnames', not {sys.argv[1:]}")
print("\n".join(h for h in sys.argv[3].split(",") if h))
"""


SCANCEL = r"""
import os, signal, sys

args = sys.argv[1:]
if len(args) != 2 or not args[0].startswith("--signal="):
    sys.exit(f"fake scancel only answers '--signal=SIG <job>', not {args}")
sig = getattr(signal, "SIG" + args[0].partition("=")[2].removeprefix("SIG"))
folder = os.path.join(STEPS, args[1])
for step in os.listdir(folder) if os.path.isdir(folder) else []:
    try:
        with open(os.path.join(folder, step)) as fh:
            pids = [int(line) for line in fh if line.strip()]
    except FileNotFoundError:
        continue  # the step has just ended
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
"""


def install(bin_dir: Path) -> Path:
    """Write ``srun``, ``scontrol`` and ``scancel`` into ``bin_dir`` (to put first on PATH); returns ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    steps = f"STEPS = {str(bin_dir / 'steps')!r}\n"  # the running steps' tasks, by job
    for name, body in (("srun", steps + SRUN), ("scontrol", SCONTROL), ("scancel", steps + SCANCEL)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return bin_dir
