"""Environment rows: versions, and whether the fast CUDA kernels Archon picks are there.

``environment`` runs everywhere and only records (it fails only if torch itself is unusable);
``cuda_environment`` judges a GPU: NCCL present, the varlen attention API Archon calls
(``torch.nn.attention.varlen.varlen_attn`` with ``scale`` and ``window_size``)
and ``torch._grouped_mm`` with a Hopper-or-newer device (below sm90 MoE layers run the
per-expert loop, which is correct but slow: reported, not failed).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
from typing import Any

import torch

from archon.gpu_check.table import Context, Outcome, judge

VARLEN_PARAMS = ("scale", "window_size")
"""Keyword arguments ``models/common/attention.py`` needs of ``varlen_attn`` (it adds ``enable_gqa`` where there)."""


def package_version(name: str) -> str | None:
    """Installed version of a distribution importable by this interpreter (the servers' too), or None."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def varlen_api() -> str:
    """'ok' (with a remark on torch 2.10-2.11), or why ``varlen_attn`` cannot serve Archon's packed attention."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"missing (torch {torch.__version__} has no torch.nn.attention.varlen; needs torch >= 2.10)"
    params = inspect.signature(varlen_attn).parameters
    lacking = [p for p in VARLEN_PARAMS if p not in params]
    if lacking:
        return f"lacks {', '.join(lacking)}"
    return "ok" if "enable_gqa" in params else "ok (no enable_gqa: grouped-query K/V heads are repeated)"


def check_environment(ctx: Context) -> Outcome:
    measured: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "varlen_api": varlen_api(),
        "grouped_mm": hasattr(torch, "_grouped_mm"),
        "sglang": package_version("sglang"),
        "vllm": package_version("vllm"),
        "transformers": package_version("transformers"),
    }
    x = torch.arange(6.0, device=ctx.device).view(2, 3)
    ok = float((x @ x.T).sum()) == 83.0  # torch runs on the device at all: (0+3)^2 + (1+4)^2 + (2+5)^2
    return judge(ok, measured, "torch computes on the device", note=f"device {ctx.device}")


def check_cuda_environment(ctx: Context) -> Outcome:
    cap = torch.cuda.get_device_capability(ctx.device)
    props = torch.cuda.get_device_properties(ctx.device)
    nccl: Any = None
    if torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()  # pyright: ignore[reportAttributeAccessIssue]
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    measured = {
        "gpu": props.name,
        "capability": f"sm{cap[0]}{cap[1]}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "nccl": nccl,
        "varlen_api": varlen_api(),
        "grouped_mm": hasattr(torch, "_grouped_mm"),
        "bf16": torch.cuda.is_bf16_supported(),
    }
    problems = []
    if nccl is None:
        problems.append("no NCCL (multi-GPU training and weight sync need it)")
    if not measured["varlen_api"].startswith("ok"):
        problems.append(f"varlen attention {measured['varlen_api']} (packed rows fall back to per-length SDPA)")
    if not measured["bf16"]:
        problems.append("no bfloat16")
    note = ""
    if cap[0] < 9 or not measured["grouped_mm"]:
        note = "MoE experts run the per-expert loop (grouped GEMM needs torch._grouped_mm and sm90+)"
    tolerance = "NCCL, varlen attention API and bf16 present"
    return judge(not problems, measured, tolerance, "; ".join(problems), note)
