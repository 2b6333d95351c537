#!/usr/bin/env bash
# SFT then RL on CPU: the example's assets, 2 SFT steps, then 2 GRPO steps from the SFT export.
# Run from the repository root: bash examples/sft_then_rl/run_cpu.sh
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
"$PY" -m archon.demos.gsm8k make-assets outputs/examples/assets
"$PY" -m torch.distributed.run --nproc_per_node=1 scripts/train_sft.py --config examples/sft_then_rl/sft_cpu.yaml "$@"
"$PY" -m torch.distributed.run --nproc_per_node=1 scripts/train_rl.py --config examples/sft_then_rl/rl_cpu.yaml
