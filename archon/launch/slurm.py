"""``python -m archon.launch slurm``: an sbatch script whose steps follow the cluster plan.

The job takes ``cluster.n_nodes`` whole nodes.  Its script, run by Slurm on the first node:

1. lists the job's hosts (``scontrol show hostnames``); plan node ``n`` is the n-th;
2. prepares the run directory on the shared filesystem (``python -m archon.launch prepare``:
   the server folder and a fresh API key);
3. starts one ``srun`` step per rollout node, in the background: ``serve-node --node n``
   starts that node's servers (each with ``CUDA_VISIBLE_DEVICES`` = its GPUs), publishes their
   addresses in ``<run_dir>/rollout/servers`` and stays up;
4. starts one ``srun`` step over the training nodes: torchrun with ``--nnodes`` = their
   number, ``--nproc_per_node`` = the plan's training ranks per node, c10d rendezvous on the
   first training node, ``CUDA_VISIBLE_DEVICES`` = the plan's training GPUs of a node;
   trainer rank 0 finds the servers in the run directory instead of launching any;
5. when training ends, fails, or the job is cancelled, stops the steps still running: SIGTERM to
   their tasks with ``scancel --signal=TERM`` (srun itself would SIGKILL them), then, for a step
   still running ``STOP_GRACE_S`` later, srun's kill.

torchrun's c10d rendezvous numbers the nodes in its own order (by host name), so every
training node must hold the same training GPUs; the plan gives that whenever training has
whole nodes (the usual layout; ``python -m archon.plan`` shows it).  Nodes are never
shared between jobs (``--exclusive``); steps that share a node (servers and training on one
node, when the cluster is too small for whole nodes) are started with ``--overlap``.

Colocated runs (``rollout.colocate``) need nothing more: every step asks for the node's GPUs
(``--gpus-per-node``) with ``--overlap``, which lets steps share CPUs, memory and GRES, so a
node's serve-node step and its torchrun step see the same GPUs and each process keeps to its
own by ``CUDA_VISIBLE_DEVICES`` (a server: its training ranks' GPUs).  Asking the serve-node
step for fewer GPUs (``--gres``) would not help: a step without ``--overlap`` would wait for
the torchrun step's GPUs, and one with it shares them anyway.  The ``inprocess`` backend has
no server step.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from archon.config import Config
from archon.errors import ClusterError
from archon.launch.common import describe_gpus, entry_point, python_executable, run_args
from archon.launch.discovery import LAUNCH_ID_ENV, REGISTRY_ENV
from archon.launch.servers import build_launch_specs
from archon.plan import ClusterPlan, Job

DEFAULT_RDZV_PORT = 29500
STOP_GRACE_S = 60
"""Seconds the steps still running when the script ends have to stop after SIGTERM, before srun kills them."""


class Shell(str):
    """A word the shell must expand (``${NODES[1]}:29500``): double-quoted, not escaped."""


def _word(token: str) -> str:
    return f'"{token}"' if isinstance(token, Shell) else shlex.quote(token)


def _host(node: int) -> Shell:
    return Shell(f"${{NODES[{node}]}}")


@dataclass
class Step:
    """One ``srun`` step: a command run once on each of ``nodes``."""

    title: str
    """What it runs, for the script's comment and the dry run."""
    nodes: tuple[int, ...]
    """Plan nodes it runs on (one task each)."""
    argv: list[str]
    """The command; ``Shell`` words are expanded by the shell."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for the command on every node of the step (via ``env``, after Slurm set its own)."""


@dataclass
class SlurmJob:
    """Everything the script says: the job's size, its environment and its steps."""

    plan: ClusterPlan
    job: Job
    workdir: Path
    """Directory the script runs in (where the launcher was started)."""
    run_dir: Path
    env: dict[str, str]
    """Exported for every step."""
    prepare: list[str]
    """The first command, on the batch node."""
    steps: list[Step]
    gpus: bool
    """Whether to ask Slurm for GPUs (not for a CPU run, whose 'GPUs' are process slots)."""
    name: str
    sbatch_args: list[str] = field(default_factory=list)


def check_torchrun_layout(plan: ClusterPlan) -> None:
    """Every training node must hold the same training GPUs (torchrun orders nodes by host name)."""
    layouts = {n: plan.train_gpus(n) for n in plan.train_nodes}
    if len(set(layouts.values())) > 1:
        shown = ", ".join(f"node {n}: GPUs {describe_gpus(g)}" for n, g in layouts.items())
        raise ClusterError(
            f"the plan gives the training nodes different GPUs ({shown}), but torchrun's c10d "
            "rendezvous numbers nodes in its own order, so each training node must hold the same "
            "training GPUs; give rollout and training whole nodes (add a node, or resize an "
            "allocation: `python -m archon.plan` shows the layout), or launch with Ray"
        )


def build_job(
    cfg: Config,
    plan: ClusterPlan,
    config: str | None,
    overrides: Sequence[str],
    job: Job = "rl",
    rdzv_port: int = DEFAULT_RDZV_PORT,
    sbatch_args: Sequence[str] = (),
) -> SlurmJob:
    """The job that runs ``cfg`` as ``plan`` says."""
    check_torchrun_layout(plan)
    py = python_executable()
    args = run_args(config, overrides)
    run_dir = cfg.run_dir.absolute()
    env = {"PYTHONUNBUFFERED": "1", LAUNCH_ID_ENV: "slurm-${SLURM_JOB_ID}"}
    steps = []
    servers = job == "rl" and not cfg.rollout.server_addrs and bool(plan.servers)
    if servers:
        env[REGISTRY_ENV] = f"file:{run_dir / 'rollout' / 'servers'}"
        for node in plan.rollout_nodes:
            on = plan.servers_on(node)
            shared = [r for s in on for r in plan.colocated_ranks(s)]
            steps.append(
                Step(
                    f"node {node}: rollout servers {', '.join(str(s.index) for s in on)} (GPUs "
                    f"{' | '.join(describe_gpus(s.gpus) for s in on)})"
                    + (f", colocated with training ranks {shared[0]}-{shared[-1]}" if shared else ""),
                    (node,),
                    [py, "-m", "archon.launch", "serve-node", "--node", str(node), *args],
                )
            )
    nodes = plan.train_nodes
    first = nodes[0]
    per_node = len(plan.train_gpus(first))
    torchrun = [
        py,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(nodes)}",
        f"--nproc_per_node={per_node}",
        "--rdzv_backend=c10d",
        Shell(f"--rdzv_endpoint=${{NODES[{first}]}}:{rdzv_port}"),
        Shell("--rdzv_id=${SLURM_JOB_ID}"),
        "--max_restarts=0",
        str(entry_point(job)),
        *args,
    ]
    where = f"node {first}" if len(nodes) == 1 else f"nodes {first}-{nodes[-1]}"
    steps.append(
        Step(
            f"{where}: training ranks 0-{plan.train_world_size - 1}, {per_node} per node on GPUs "
            f"{describe_gpus(plan.train_gpus(first))}; torchrun's c10d rendezvous on node {first}",
            nodes,
            torchrun,
            {"CUDA_VISIBLE_DEVICES": ",".join(map(str, plan.train_gpus(first)))},
        )
    )
    prepare = [py, "-m", "archon.launch", "prepare", *args] if servers else []
    name = f"archon-{cfg.experiment_name}-{cfg.trial_name}"
    return SlurmJob(plan, job, Path.cwd(), run_dir, env, prepare, steps, cfg.device != "cpu", name, list(sbatch_args))


def _srun(job: SlurmJob, step: Step) -> str:
    hosts = ",".join(f"${{NODES[{n}]}}" for n in step.nodes)
    opts = [
        f"--nodes={len(step.nodes)}",
        f"--ntasks={len(step.nodes)}",
        "--ntasks-per-node=1",
        f'--nodelist="{hosts}"',
        '--cpus-per-task="${SLURM_CPUS_ON_NODE}"',
        "--overlap",
        "--kill-on-bad-exit=1",
    ]
    if job.gpus:
        opts.append(f"--gpus-per-node={job.plan.n_gpus_per_node}")
    command = (["env"] + [f"{k}={v}" for k, v in step.env.items()] if step.env else []) + step.argv
    lines = ["srun " + " ".join(opts)] + ["    " + " ".join(_word(t) for t in command)]
    return " \\\n".join(lines)


def log_path(job: SlurmJob) -> Path:
    """The job's output (``%j``: its id); Slurm fails a job whose log folder is missing, so the launcher makes it."""
    return job.run_dir / "launch" / "slurm-%j.log"


def render_script(job: SlurmJob) -> str:
    """The sbatch script (see the module docstring)."""
    plan = job.plan
    n = plan.n_nodes
    log = log_path(job)
    head = [
        "#!/bin/bash",
        "# An Archon run on Slurm, written by `python -m archon.launch slurm`; its steps follow the cluster plan",
        "# (`python -m archon.plan` with the same config and overrides prints it).",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --nodes={n}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --output={log}",
    ]
    if job.gpus:
        head.append(f"#SBATCH --gpus-per-node={plan.n_gpus_per_node}")
    head += [f"#SBATCH {arg}" for arg in job.sbatch_args]
    body = ["", "set -euo pipefail", f"cd {shlex.quote(str(job.workdir))}"]
    body += [f'export {k}="{v}"' if "$" in v else f"export {k}={shlex.quote(v)}" for k, v in job.env.items()]
    body += [
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"if (( ${{#NODES[@]}} < {n} )); then",
        f'    echo "archon: this job has ${{#NODES[@]}} node(s) but the plan needs {n} (cluster.n_nodes)" >&2',
        "    exit 2",
        "fi",
        "",
        "# Every step runs in the background; whatever ends the script stops the ones still running:",
        "# SIGTERM to their tasks through Slurm (not to this script), so serve-node and torchrun stop their",
        "# own processes.  srun answers a SIGTERM by killing its tasks (SIGKILL): it gets one only for a step",
        f"# still running {STOP_GRACE_S} s later.",
        "STEPS=()",
        "stop_steps() {",
        "    trap - EXIT INT TERM",
        f"    local tenths={STOP_GRACE_S * 10}",
        '    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || tenths=0',
        '    while [[ -n "$(jobs -pr)" ]] && (( tenths-- > 0 )); do sleep 0.1; done',
        '    for pid in "${STEPS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done',
        "    wait || true",
        "}",
        "trap stop_steps EXIT",
        "trap 'exit 130' INT",
        "trap 'exit 143' TERM",
    ]
    if job.prepare:
        body += [
            "",
            "# The server folder and a fresh API key, in the run directory on the shared filesystem.",
            " ".join(_word(t) for t in job.prepare),
        ]
    for step in job.steps:
        body += ["", f"# {step.title}", _srun(job, step) + " &", "STEPS+=($!)"]
    body += ["", "# The run ends with training: its exit status is the job's.", 'wait "${STEPS[-1]}"', ""]
    return "\n".join(head + body)


def _display(tokens: Sequence[str]) -> str:
    """A command as the dry run shows it: shell words and <placeholders> unquoted."""
    return " ".join(t if isinstance(t, Shell) or t.startswith("<") else shlex.quote(t) for t in tokens)


def dry_run_text(job: SlurmJob, cfg: Config) -> str:
    """Each node's commands and environment, as the script would run them."""
    plan = job.plan
    out = [
        f"Slurm job '{job.name}': {plan.n_nodes} node(s); plan node n runs on ${{NODES[n]}}, the n-th host of "
        "`scontrol show hostnames $SLURM_JOB_NODELIST`.",
        "Every step's environment:",
    ]
    out += [f"  {k}={v}" for k, v in job.env.items()]
    if job.prepare:
        out += ["On the batch node, first:", "  " + _display(job.prepare)]
    for step in job.steps:
        for node in step.nodes:
            servers = plan.servers_on(node) if "serve-node" in step.argv else ()
            if servers:
                what = f"rollout servers {', '.join(str(s.index) for s in servers)}"
            else:
                ranks = plan.train_ranks_on(node)
                what = (
                    f"training ranks {ranks[0].index}-{ranks[-1].index} in the plan (torchrun numbers the nodes "
                    "in its own order)"
                )
            out += ["", f"node {node} (${{NODES[{node}]}}): {what}"]
            out += [f"  {k}={v}" for k, v in step.env.items()]
            out.append("  " + _display(step.argv))
            if servers:
                specs = build_launch_specs(cfg, job.run_dir, node=node, ports=[0] * len(servers), api_key="<api key>")
                out.append("  which starts, each on a free port, and publishes its host:port once healthy:")
                for spec in specs:
                    cmd = ["<port>" if prev == "--port" else t for prev, t in zip([""] + spec.cmd, spec.cmd)]
                    env = " ".join(f"{k}={v}" for k, v in spec.env.items() if k != "PYTHONUNBUFFERED")
                    out.append(f"    server {spec.index} (log {spec.log_path}): {env} {_display(cmd)}")
    return "\n".join(out)


def default_script_path(job: SlurmJob) -> Path:
    return job.run_dir / "launch" / "slurm.sbatch"


def submit(script: Path) -> str:
    """``sbatch <script>``; sbatch's answer ('Submitted batch job N')."""
    if shutil.which("sbatch") is None:
        raise ClusterError(
            f"sbatch is not on PATH, so {script} cannot be submitted from here; run "
            f"`sbatch {script}` on a Slurm login node"
        )
    done = subprocess.run(["sbatch", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()
