"""Defaults that depend on where the run is: compute dtype and torch.compile.

On CUDA Archon trains in bfloat16 with every block compiled; on CPU in float32 without compile
(bfloat16 on CPU is slow and inexact, and compile costs minutes of start-up for nothing there).
Only keys the user did not set are chosen (``actor.dtype``, ``actor.archon.enable_compile``);
critic, ref and teacher inherit them from actor as any other engine field.

``device = 'auto'`` is resolved from the config first and the machine second, so a config checked
on a login node (``python -m archon.config`` on a CPU box) gets the defaults it will run with:

1. ``rollout.backend`` 'sglang' or 'vllm' means a GPU run (those servers run on CUDA only): cuda;
2. otherwise cuda when this machine shows a CUDA (or ROCm) device, else cpu.

``cluster.n_gpus_per_node`` says nothing here: on a CPU machine it counts processes per node.
``cfg.device`` itself keeps 'auto' (the launchers read it as "GPUs when there are some"); the
resolved device only picks the defaults. A GPU cluster's config with a built-in rollout server,
checked on a CPU login node, therefore shows the CPU defaults; set ``device = 'cuda'`` to pin them.
"""

from __future__ import annotations

import glob
import os
from typing import Literal

from archon.config.schema import Config

Device = Literal["cpu", "cuda"]

DEVICE_DEFAULTS: dict[str, tuple[str, bool]] = {"cuda": ("bfloat16", True), "cpu": ("float32", False)}
"""Device type -> (``actor.dtype``, ``actor.archon.enable_compile``) when the user set neither."""

GPU_ROLLOUT_BACKENDS = ("sglang", "vllm")
"""Rollout backends whose servers run only on CUDA devices: a config naming one is a GPU run."""


def cuda_device_visible() -> bool:
    """Whether this machine shows a CUDA or ROCm device to this process (device files; no torch import)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def resolve_device(cfg: Config) -> Device:
    """The device type the run's defaults are chosen for: ``cfg.device``, or for 'auto' see the module doc."""
    if cfg.device != "auto":
        return cfg.device
    if cfg.rollout.backend.split(":", 1)[0] in GPU_ROLLOUT_BACKENDS:
        return "cuda"
    return "cuda" if cuda_device_visible() else "cpu"


def apply_device_defaults(cfg: Config, explicit: set[str]) -> None:
    """Set ``actor.dtype`` and ``actor.archon.enable_compile`` for the resolved device unless the user set them.

    Runs before critic/ref/teacher inherit actor's engine fields, so they follow it.
    """
    dtype, compile_ = DEVICE_DEFAULTS[resolve_device(cfg)]
    if "actor.dtype" not in explicit:
        cfg.actor.dtype = dtype  # pyright: ignore[reportAttributeAccessIssue] - a member of the Literal
    if "actor.archon.enable_compile" not in explicit:
        cfg.actor.archon.enable_compile = compile_


def describe_device_choice(cfg: Config) -> str:
    """One line for the log at start: the device the defaults are for, and what dtype and compile are."""
    device = resolve_device(cfg)
    dtype, compile_ = DEVICE_DEFAULTS[device]
    a = cfg.actor
    shown = f"device = '{cfg.device}'" + (f" (resolved to {device})" if cfg.device == "auto" else "")

    def origin(same: bool) -> str:
        return f"the {device} default" if same else "set in the config"

    return (
        f"{shown}: actor.dtype = {a.dtype} ({origin(a.dtype == dtype)}), actor.archon.enable_compile = "
        f"{str(a.archon.enable_compile).lower()} ({origin(a.archon.enable_compile == compile_)}); "
        "Archon's defaults are bfloat16 with compile on cuda, float32 without compile on cpu"
    )
