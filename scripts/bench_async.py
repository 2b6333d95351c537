"""Synchronous vs asynchronous RL on the same config: training speed and what was learned.

    python scripts/bench_async.py [--config configs/cpu_demo.toml] [--k 0 1 2] [--seeds 1 2 3]
                                  [--nproc 1] [--out outputs/bench_async] [key=value ...]

For every seed it runs the config once per ``rollout.max_head_offpolicyness`` in ``--k`` (0 is
the synchronous trainer), one run after another so that the runs of a seed see the same
machine load, each a fresh ``torchrun scripts/train_rl.py`` writing its own metrics.jsonl.  It
prints, per run: steps per second over the training loop (setup excluded: the sum of
``step_time_s``), the final reward (mean of the last ``--last`` steps), the first step whose
reward reached ``--target``, the largest measured staleness, and the load average of the
machine during the run; then, per k, the mean speed-up over k = 0 and the mean final reward.
``--plot FILE`` draws the reward of every run against the step and against training time.
Extra ``key=value`` arguments override the config for every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]


def run_one(config: str, out: Path, seed: int, k: int, nproc: int, overrides: list[str]) -> dict:
    """One training run; its summary."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "scripts" / "train_rl.py"),
        "--config",
        config,
        f"output_dir={out}",
        f"seed={seed}",
        f"rollout.max_head_offpolicyness={k}",
        "saver.export_hf=false",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # A run folder left from before holds a finished run's checkpoints, which would be resumed.
    shutil.rmtree(out, ignore_errors=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run seed={seed} k={k} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"seed": seed, "k": k, "records": records, "wall_s": wall, "load": (load_before + os.getloadavg()[0]) / 2}


def summarize(run: dict, last: int, target: float) -> dict:
    records = run["records"]
    train_s = sum(r["step_time_s"] for r in records)
    rewards = [r["reward_mean"] for r in records]
    reached = next((r["step"] for r in records if r["reward_mean"] >= target), None)
    return {
        "seed": run["seed"],
        "k": run["k"],
        "steps": len(records),
        "steps_per_s": len(records) / train_s,
        "final_reward": mean(rewards[-last:]),
        "reached": reached,
        "staleness_max": max((r.get("async/staleness_max") or 0.0) for r in records),
        "wall_s": run["wall_s"],
        "load": run["load"],
    }


def plot_runs(runs: list[dict], path: Path) -> None:
    """Reward against step and against training seconds, one line per run (colour = k)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    by_step, by_time = fig.subplots(1, 2)
    colours: dict[int, str] = {}
    for run in runs:
        records = run["records"]
        label = None if run["k"] in colours else f"k={run['k']}"  # one legend entry per k
        colour = colours.setdefault(run["k"], f"C{len(colours)}")
        steps = [r["step"] for r in records]
        rewards = [r["reward_mean"] for r in records]
        seconds, total = [], 0.0
        for r in records:
            total += r["step_time_s"]
            seconds.append(total)
        by_step.plot(steps, rewards, color=colour, alpha=0.8, linewidth=1.2, label=label)
        by_time.plot(seconds, rewards, color=colour, alpha=0.8, linewidth=1.2, label=label)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training time (s, setup excluded)")
    for ax in (by_step, by_time):
        ax.set_ylabel("mean reward")
        ax.grid(True, alpha=0.3)
        ax.legend(title="max_head_offpolicyness", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "cpu_demo.toml"))
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2], help="max_head_offpolicyness values")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--nproc", type=int, default=1, help="training processes per run")
    parser.add_argument("--out", default="outputs/bench_async")
    parser.add_argument("--last", type=int, default=5, help="steps averaged for the final reward")
    parser.add_argument("--target", type=float, default=0.9, help="reward whose first step is reported")
    parser.add_argument("--plot", help="PNG file for the reward curves of every run")
    args, overrides = parser.parse_known_args(argv)
    if 0 not in args.k:
        parser.error("--k must include 0: speed-ups are against the synchronous run")
    rows, runs = [], []
    print(
        f"{'seed':>4} {'k':>2} {'steps/s':>8} {'final reward':>12} {'reached@':>8} {'staleness max':>13} "
        f"{'wall s':>7} {'load':>5}",
        flush=True,
    )
    for seed in args.seeds:
        for k in args.k:
            run = run_one(args.config, Path(args.out) / f"seed{seed}_k{k}", seed, k, args.nproc, overrides)
            runs.append(run)
            row = summarize(run, args.last, args.target)
            rows.append(row)
            print(
                f"{seed:>4} {k:>2} {row['steps_per_s']:>8.3f} {row['final_reward']:>12.3f} "
                f"{str(row['reached']):>8} {row['staleness_max']:>13.0f} {row['wall_s']:>7.1f} {row['load']:>5.1f}",
                flush=True,
            )
    print("\nper k, mean over seeds (speed-up = steps/s over the same seed's k = 0):")
    base = {r["seed"]: r["steps_per_s"] for r in rows if r["k"] == 0}
    for k in args.k:
        mine = [r for r in rows if r["k"] == k]
        speedup = mean(r["steps_per_s"] / base[r["seed"]] for r in mine)
        finals = [r["final_reward"] for r in mine]
        per_seed = ", ".join(f"{x:.3f}" for x in finals)
        print(
            f"  k={k}: speed-up {speedup:.2f}x, final reward {mean(finals):.3f} (per seed {per_seed}), "
            f"staleness max {max(r['staleness_max'] for r in mine):.0f}"
        )
    if args.plot:
        plot_runs(runs, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
