"""Memory and checkpoint rows: the memory estimate, parameter offloading, a DCP round trip.

* ``memory_estimate`` (CUDA): ``archon.plan.memory.estimate_training_rank`` for a 170M Qwen3 on
  ``archon:d1`` in bf16 (8 x 1024 tokens; without AC, with op-level selective AC and with full AC) against
  the peaks of ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over two steps.
  The estimate counts tensors, so peak allocated must be 0.8x-1.2x of it (below, users are told
  to shrink runs that fit; above, runs it passes may not fit), and peak reserved (what the
  allocator takes from the device, fragmentation included) at most 1.25x.
* ``offload`` (CUDA): FSDP2's CPU offload as ``archon.offload_params`` applies it, on the one GPU
  (the engine needs d*c > 1 for FSDP, so this runs ``parallel.fsdp`` on a 1-rank mesh): the
  parameters must live on the host, the peak CUDA memory must drop by at least half of the float32
  states (params + AdamW, 12 bytes a parameter), and the losses must match the run without offload
  within 1e-3 (same bf16 compute; only AdamW runs on the host instead).
* ``dcp_roundtrip`` (any device): train 2 steps, ``save``; a fresh engine with another seed
  ``load``s it: weights equal bit for bit, step and extra state restored, and the next step
  (which reads the AdamW moments and the LR schedule) equal to the uninterrupted one.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig

import models
from archon.engine import TrainEngine
from archon.engine.weights import init_from_seed
from archon.gpu_check import tiny
from archon.gpu_check.table import Context, Outcome, judge
from archon.gpu_check.tiny import relative_gap
from archon.plan.memory import Workload, estimate_training_rank
from models.common.decoder import Decoder
from parallel.fsdp import apply_fsdp

GiB = 2**30
ALLOCATED_RANGE = (0.8, 1.2)
RESERVED_MAX = 1.25
OFFLOAD_LOSS_TOL = 1e-3


def full_batch(rows: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` sequences of exactly ``seq_len`` tokens, every one in the loss (what the estimate assumes)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(1, vocab, (rows, seq_len), generator=g),
        "attention_mask": torch.ones(rows, seq_len, dtype=torch.long),
        "loss_mask": torch.ones(rows, seq_len, dtype=torch.float32),
    }


def release_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def local_device(p: torch.Tensor) -> str:
    """Where a parameter's own data lives (a DTensor's local shard)."""
    local = p.to_local() if hasattr(p, "to_local") else p  # pyright: ignore[reportAttributeAccessIssue]
    return local.device.type


def peak_of_steps(
    ctx: Context, config: Any, batch: dict[str, torch.Tensor], steps: int = 2
) -> tuple[dict[str, float], list[float], set[str]]:
    """Peak reserved/allocated bytes above what was held before, the losses, and the parameters' devices."""
    release_cuda()
    held_reserved = torch.cuda.memory_reserved(ctx.device)
    held_allocated = torch.cuda.memory_allocated(ctx.device)
    engine = tiny.new_engine(ctx, config, "cuda", steps)
    losses = [engine.train_batch(batch, tiny.sft_loss, tiny.sft_weight)["loss"] for _ in range(steps)]
    assert engine.model is not None
    devices = {local_device(p) for p in engine.model.parameters()}
    peak = {
        "reserved": float(torch.cuda.max_memory_reserved(ctx.device) - held_reserved),
        "allocated": float(torch.cuda.max_memory_allocated(ctx.device) - held_allocated),
    }
    del engine
    release_cuda()
    return peak, losses, devices


def check_memory_estimate(ctx: Context) -> Outcome:
    folder = tiny.model_folder(ctx, "mid")
    hf = json.loads((Path(folder) / "config.json").read_text())
    rows, seq_len = 8, 1024
    batch = full_batch(rows, seq_len, hf["vocab_size"])
    measured: dict[str, Any] = {}
    problems = []
    lo, hi = ALLOCATED_RANGE
    cases: dict[str, dict[str, Any]] = {
        "no_ac": {},
        "ac_op": {"gradient_checkpointing": True},  # the default: selective, op level
        "ac_full": {"gradient_checkpointing": True, "archon": {"ac_mode": "full"}},
    }
    for case, overrides in cases.items():
        config = tiny.engine_config(folder, "bfloat16", **overrides)
        estimate = estimate_training_rank(config, hf, Workload(rows, seq_len), device_type="cuda")
        peak, _, _ = peak_of_steps(ctx, config, batch)
        allocated, reserved = peak["allocated"] / estimate.total, peak["reserved"] / estimate.total
        measured[f"{case}:estimate_gib"] = round(estimate.total / GiB, 3)
        measured[f"{case}:allocated/estimate"] = round(allocated, 3)
        measured[f"{case}:reserved/estimate"] = round(reserved, 3)
        measured[f"{case}:largest_term"] = f"{estimate.dominant.name} {estimate.dominant.bytes / GiB:.2f} GiB"
        if not lo <= allocated <= hi:
            problems.append(f"{case}: peak allocated is {allocated:.2f}x the estimate")
        if reserved > RESERVED_MAX:
            problems.append(f"{case}: peak reserved is {reserved:.2f}x the estimate")
    tolerance = f"{lo} <= max allocated / estimate <= {hi}; max reserved / estimate <= {RESERVED_MAX}"
    return judge(not problems, measured, tolerance, "; ".join(problems), note="170M qwen3, bf16, 8x1024")


def train_fsdp(ctx: Context, folder: str, offload: bool, steps: int = 2) -> tuple[list[float], set[str], int]:
    """Losses, the parameters' devices and the parameter count of a 1-rank FSDP2 model (bf16 compute).

    Built as the engine builds an offloaded model: meta device, ``parallel.fsdp.apply_fsdp`` per
    block and root, parameters materialised on the CPU under offload (FSDP2 refuses others),
    buffers on the compute device, weights drawn from one seed whatever the placement.
    """
    hf = AutoConfig.from_pretrained(folder)
    spec = models.get_model_spec(hf.model_type)
    args = spec.model_args_class.from_hf_config(hf)
    with torch.device("meta"):
        model = cast(Decoder, spec.model_class(args))
    mesh = init_device_mesh(ctx.device.type, (1,))
    apply_fsdp(model, mesh, list(model.layers.values()), param_dtype="bfloat16", cpu_offload=offload)
    model.to_empty(device="cpu" if offload else ctx.device)
    model.init_buffers(ctx.device)  # RoPE tables; FSDP leaves buffers where they are
    init_from_seed(model, lambda: spec.model_class(args), seed=1)  # full tensors drawn on the CPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf.vocab_size, (2, 257), generator=g).to(ctx.device)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    devices = {local_device(p) for p in model.parameters()}
    n_params = sum(p.numel() for p in model.parameters())
    return losses, devices, n_params


def check_offload(ctx: Context) -> Outcome:
    folder = tiny.model_folder(ctx, "mid")
    peaks = {}
    runs = {}
    for offload in (False, True):
        release_cuda()
        held = torch.cuda.memory_allocated(ctx.device)
        runs[offload] = train_fsdp(ctx, folder, offload)
        peaks[offload] = torch.cuda.max_memory_allocated(ctx.device) - held
        release_cuda()
    (base_losses, _, n_params), (off_losses, devices, _) = runs[False], runs[True]
    states = 12 * n_params  # float32 parameters and AdamW's two moments
    saved = peaks[False] - peaks[True]
    loss_gap = relative_gap(off_losses, base_losses)
    measured = {
        "param_devices": sorted(devices),
        "peak_mib": round(peaks[False] / 2**20, 1),
        "offload_peak_mib": round(peaks[True] / 2**20, 1),
        "states_mib": round(states / 2**20, 1),
        "loss_gap": loss_gap,
    }
    problems = []
    if devices != {"cpu"}:
        problems.append(f"offloaded parameters live on {', '.join(sorted(devices))}")
    if saved < 0.5 * states:
        problems.append(f"peak CUDA memory dropped by {saved / 2**20:.0f} MiB, under half the states")
    if loss_gap > OFFLOAD_LOSS_TOL:
        problems.append(f"losses moved by {loss_gap:.3g} (rel)")
    tolerance = f"params on cpu; peak drops >= states/2; loss <= {OFFLOAD_LOSS_TOL:g} (rel)"
    # One GPU: the engine refuses offload without FSDP (d*c = 1), so the technique runs on a 1-rank mesh.
    note = "FSDP2 CPUOffloadPolicy via parallel.fsdp on a 1-rank mesh (the engine needs d*c > 1 for it)"
    return judge(not problems, measured, tolerance, "; ".join(problems), note=note)


def max_weight_gap(a: TrainEngine, b: TrainEngine) -> float:
    """Largest absolute difference between two engines' full tensors, routing bias included."""
    ta, tb = dict(a.named_full_tensors(extras=True)), dict(b.named_full_tensors(extras=True))
    assert ta.keys() == tb.keys(), "both engines build the same model"
    return max(float((ta[k].float() - tb[k].float()).abs().max()) for k in ta)


def check_dcp_roundtrip(ctx: Context) -> Outcome:
    device = ctx.device.type
    dtype = "bfloat16" if ctx.cuda else "float32"
    # Same device and kernels: the next step repeats exactly, but for atomic adds on CUDA.
    step_tol, weight_tol = (1e-4, 1e-5) if ctx.cuda else (1e-6, 1e-7)
    measured: dict[str, Any] = {}
    problems = []
    for kind in ("dense", "moe"):
        config = tiny.engine_config(tiny.model_folder(ctx, kind), dtype)
        first = tiny.new_engine(ctx, config, device, total_steps=3)
        tiny.train(first, 2)
        path = ctx.workdir / "dcp" / kind
        first.save(path, extra_state={"data_position": 2})
        second = tiny.new_engine(ctx, config, device, total_steps=3, seed=2)
        before = max_weight_gap(first, second)  # another seed: a load that does nothing shows
        extra = second.load(path)
        loaded = max_weight_gap(first, second)
        a, b = tiny.train(first, 1, first=2)[0], tiny.train(second, 1, first=2)[0]
        step_gap = max(relative_gap([b["loss"]], [a["loss"]]), relative_gap([b["grad_norm"]], [a["grad_norm"]]))
        after = max_weight_gap(first, second)
        measured.update({f"{kind}:before_load": before, f"{kind}:loaded": loaded, f"{kind}:next_step": step_gap})
        measured[f"{kind}:after_step"] = after
        if extra != {"data_position": 2} or second.step != 3:
            problems.append(f"{kind}: extra state {extra} / step {second.step} not restored")
        if before == 0.0:
            problems.append(f"{kind}: engines of different seeds start equal; the check cannot see a missed load")
        if loaded > 0.0 or step_gap > step_tol or after > weight_tol:
            problems.append(f"{kind}: the loaded engine does not continue the saved one")
    tolerance = f"weights equal; next step <= {step_tol:g} (rel), weights after it <= {weight_tol:g}"
    return judge(not problems, measured, tolerance, "; ".join(problems), note=f"{device} {dtype}, dense and moe")
