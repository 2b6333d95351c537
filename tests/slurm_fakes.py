"""Stand-ins for Slurm's ``srun`` and ``scontrol`` that run a job's steps on this machine.

``install(bin_dir)`` writes two executables.  ``scontrol show hostnames a,b`` prints the
comma-separated hosts one per line (real Slurm also expands ``node[1-3]``; the tests name
hosts plainly).  ``srun --nodelist=a,b [options] cmd ...`` runs ``cmd`` once per listed
host, as a simulated node: with the variables Slurm sets in a task (``SLURM_NODEID``,
``SLURM_PROCID``, ``SLURMD_NODENAME`` ...), forwarding SIGTERM/SIGINT to the tasks as srun
does, killing the others when one fails (``--kill-on-bad-exit``), and exiting with the
highest task status.  Each call is appended as a JSON line to ``$FAKE_SRUN_LOG``.
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

def forward(signum, frame):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)

signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
for i, host in enumerate(hosts):
    env = dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0", SLURMD_NODENAME=host,
               SLURM_STEP_NUM_NODES=str(len(hosts)), SLURM_STEP_NODELIST=",".join(hosts))
    procs.append(subprocess.Popen(args, env=env))
while any(p.poll() is None for p in procs):
    if "kill-on-bad-exit" in opts and any(p.poll() not in (None, 0) for p in procs):
        forward(signal.SIGKILL, None)
    time.sleep(0.05)
codes = [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs]
sys.exit(max(codes))
"""

SCONTROL = r"""
import sys

if sys.argv[1:3] != ["show", "hostnames"]:
    sys.exit(f"fake scontrol only answers 'show hostnames', not {sys.argv[1:]}")
print("\n".join(h for h in sys.argv[3].split(",") if h))
"""


def install(bin_dir: Path) -> Path:
    """Write ``srun`` and ``scontrol`` into ``bin_dir`` (to put first on PATH); returns ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return bin_dir
