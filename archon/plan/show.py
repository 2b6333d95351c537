"""``python -m archon.plan``: the cluster plan as a table, and the memory check; ``rehearse`` runs a layout.

    python -m archon.plan --config x.toml [--job rl|sft] [--json] [dotted.key=value ...]
    python -m archon.plan rehearse --config x.toml [--steps N] [dotted.key=value ...]

Neither needs a GPU.  The plan exits with 0 when the run fits, 1 when the memory check says it
does not, 2 on a config or layout error; the rehearsal with 0 when the layout trains like one
device.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from archon.alloc import ModelAllocation
from archon.config import load_config
from archon.errors import user_error_types
from archon.placement import ClusterPlan, Process
from archon.plan import layout
from archon.plan.fit import check_fit
from archon.plan.memory import GiB
from archon.plan.params import MemoryEstimateError


def _coordinates(rank: int, alloc: str) -> str:
    """pp/dp/cp/tp coordinates of a training rank (ranks are laid out [pp, dp, cp, tp], tp fastest)."""
    p = ModelAllocation.from_str(alloc).parallel
    tp, rest = rank % p.tp_size, rank // p.tp_size
    cp, rest = rest % p.cp_size, rest // p.cp_size
    dp, pp = rest % p.dp_size, rest // p.dp_size
    parts = [
        (n, v, s)
        for n, v, s in (("pp", pp, p.pp_size), ("dp", dp, p.dp_size), ("cp", cp, p.cp_size), ("tp", tp, p.tp_size))
        if s > 1
    ]
    return " ".join(f"{n}{v}" for n, v, _ in parts)


def _ranks_text(ranks: Sequence[int]) -> str:
    """'rank 3' or 'ranks 2-3' (a colocated server's ranks are consecutive)."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def layout_note(plan: ClusterPlan) -> str:
    """One sentence on how servers and training ranks share the cluster, or '' when they do not."""
    if plan.rollout and not plan.servers:
        return (
            f"rollout '{plan.rollout}' generates inside each training rank, on the weights it trains: no rollout "
            "process, no weight sync"
        )
    if plan.colocated:
        return (
            "rollout servers and training ranks take turns on the same GPUs (rollout.colocate): the servers release "
            "their memory while the trainer trains"
        )
    if plan.shared_nodes:
        return (
            f"node(s) {', '.join(map(str, plan.shared_nodes))} hold both rollout servers and training "
            "ranks (the cluster has too few nodes for whole rollout nodes)"
        )
    return ""


def _describe(proc: Process, plan: ClusterPlan) -> str:
    if proc.role == "rollout":
        ranks = plan.colocated_ranks(proc)
        shared = f", colocated with training {_ranks_text(ranks)}" if ranks else ""
        return f"server {proc.index} ({plan.rollout}){shared}"
    coords = _coordinates(proc.index, plan.train)
    return f"rank {proc.index}" + (f" ({coords})" if coords else "")


def plan_table(plan: ClusterPlan):
    """A rich Table: one row per process (node, GPUs, role, process) and one per idle GPU range."""
    table = Table(title=f"Cluster plan: {plan.n_nodes} node(s) x {plan.n_gpus_per_node} GPUs")
    for col in ("node", "GPUs", "role", "process"):
        table.add_column(col, justify="right" if col == "node" else "left", no_wrap=True)
    for node in range(plan.n_nodes):
        for proc in plan.on_node(node):
            table.add_row(str(node), ",".join(map(str, proc.gpus)), proc.role, _describe(proc, plan))
        idle = plan.idle_gpus(node)
        if idle:
            table.add_row(str(node), ",".join(map(str, idle)), "idle", "")
        if node != plan.n_nodes - 1:
            table.add_section()
    return table


def _print_memory(console, cfg, job: str, device: str) -> bool:
    try:
        report = check_fit(cfg, job, device)
    except MemoryEstimateError as exc:
        console.print(f"[bold]memory check skipped:[/] {exc}", highlight=False)
        return True
    console.print(
        f"\n[bold]Memory check[/] against cluster.gpu_memory_gb = {cfg.cluster.gpu_memory_gb:g} GiB per GPU ({device})",
        highlight=False,
    )
    for est in report.estimates:
        console.print(f"  {est.what}: {est.total / GiB:.1f} GiB", highlight=False)
        for term in est.terms:
            console.print(f"    {term.bytes / GiB:8.2f} GiB  {term.name}", highlight=False)
        ok = est.total <= (est.limit or report.gpu_bytes)
        style = "green" if ok else "bold red"
        console.print(f"  [{style}]{report.verdict(est)}[/]", highlight=False)
    if report.fixes:
        console.print("  checked to fit (each alone):", highlight=False)
        for fix in report.fixes:
            console.print(f"    {fix}", highlight=False)
    elif not report.fits_train():
        console.print(
            "  no single change tried (activation checkpointing, ZBV, more microbatches, resharding, "
            "a larger t, p or e) makes it fit; add GPUs",
            highlight=False,
        )
    for note in report.notes:
        console.print(f"  [dim]({note})[/]", highlight=False)
    console.print(
        ("[bold green]the run fits[/]" if report.fits else "[bold red]the run does not fit[/]")
        + f" on {cfg.cluster.gpu_memory_gb:g} GiB GPUs",
        highlight=False,
    )
    return report.fits


def main_plan(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m archon.plan",
        description="Print where every process of a run goes and whether it fits "
        "in GPU memory (no GPU needed).  `python -m archon.plan rehearse "
        "--help` rehearses a layout on this machine.",
    )
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--job", choices=("rl", "sft"), default="rl", help="sft starts no rollout server")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="estimate memory for GPU ranks (default) or CPU processes",
    )
    parser.add_argument("--json", action="store_true", help="print only the plan, as JSON (for launchers)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        cfg = load_config(args.config, args.overrides, job=args.job)
        plan = layout.plan_for_config(cfg, args.job)
    except user_error_types() as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    console.print(plan_table(plan))
    note = layout_note(plan)
    if note:
        console.print(note, highlight=False)
    try:
        fits = _print_memory(console, cfg, args.job, args.device)
    except user_error_types() as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    return 0 if fits else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "rehearse":
        from archon.plan.rehearse import main as rehearse_main

        return rehearse_main(argv[1:])
    return main_plan(argv)
