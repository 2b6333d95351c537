"""Supervised fine-tuning.

    torchrun --nproc_per_node=N scripts/train_sft.py --config x.toml [dotted.key=value ...]

Rerunning the same command with the same output_dir resumes from the last checkpoint.
"""

from __future__ import annotations

from archon.cli import exit_process, run_job
from archon.sft import run_sft

if __name__ == "__main__":
    exit_process(run_job(run_sft, __doc__, kind="sft"))
