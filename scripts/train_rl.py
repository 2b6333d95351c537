"""RL post-training (PPO / GRPO) with rollouts from SGLang or Archon's built-in servers.

    torchrun --nproc_per_node=N scripts/train_rl.py --config x.toml [dotted.key=value ...]

Rerunning the same command with the same output_dir resumes from the last checkpoint.
"""

from __future__ import annotations

from archon.cli import exit_process, run_job
from archon.rl.trainer import RLTrainer

if __name__ == "__main__":
    exit_process(run_job(lambda cfg: RLTrainer(cfg).run(), __doc__))
