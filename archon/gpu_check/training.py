"""Engine rows: ``archon:d1`` training steps of tiny dense and MoE models, compile, AC, host syncs.

* ``train_dense`` / ``train_moe``: the float32 CPU engine's first step must equal a plain,
  unpacked forward/backward of the same weights (exported with ``export_hf`` and loaded with
  ``models.load_hf_model``: an independent path); then the device's run must follow the float32
  CPU run for 3 steps.  On CUDA that run is bfloat16 (autocast): losses within 1e-2 relative,
  gradient norms within 2e-2 (bf16 vs fp32 on CPU measures 1e-4 and 6e-4 on these models); the
  MoE row reports which experts kernel the step ran (under autocast the experts see float32
  weights and input, so they take the per-expert loop rather than the grouped GEMM).  On CPU the
  run is float32 cut into 2 microbatches (another packing and accumulation path), within 1e-5.
* ``activation_checkpointing``: full, selective per op and every 2nd block, each against the same
  run without AC: recomputation repeats the same kernels, so 1e-5 in float32 and 1e-3 in bf16
  (atomic adds in backward may reorder).  Peak CUDA memory per mode is reported.
* ``compile_dense`` / ``compile_moe`` (CUDA): torch.compile per block (and, dense, AC with a
  memory budget, which needs compile) against eager bf16, within 1e-2 / 2e-2 (inductor fuses and
  rounds differently).  Skipped on CPU: a cold compile costs ~25 s per block there.
* ``host_syncs`` (CUDA): synchronizing CUDA calls in one train step after warm-up, counted with
  ``torch.cuda.set_sync_debug_mode('warn')``, with the lines that made them; measured, not judged.
"""

from __future__ import annotations

import gc
import math
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import models
from archon.gpu_check import tiny
from archon.gpu_check.kernels import OpNames
from archon.gpu_check.table import Context, Outcome, judge
from archon.gpu_check.tiny import make_batch, relative_gap

STEPS = 3
FP32_TOL = 1e-5
LOSS_TOL = 1e-2
GRAD_NORM_TOL = 2e-2
AC_TOL_BF16 = 1e-3
AC_MODES: dict[str, dict[str, Any]] = {
    "full": {"ac_mode": "full"},
    "selective_op": {"ac_mode": "selective", "selective_ac_option": "op"},
    "selective_2": {"ac_mode": "selective", "selective_ac_option": "2"},
}


def curves(stats: list[dict[str, float]]) -> tuple[list[float], list[float]]:
    return [s["loss"] for s in stats], [s["grad_norm"] for s in stats]


def run(ctx: Context, kind: str, device: str, dtype: str, steps: int = STEPS, **overrides: Any) -> dict[str, Any]:
    """Losses, gradient norms and peak CUDA memory of ``steps`` steps of a fresh engine."""
    engine = tiny.new_engine(ctx, tiny.engine_config(tiny.model_folder(ctx, kind), dtype, **overrides), device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    losses, norms = curves(tiny.train(engine, steps))
    peak = torch.cuda.max_memory_allocated(ctx.device) if device == "cuda" else 0
    del engine
    gc.collect()
    return {"loss": losses, "grad_norm": norms, "peak_bytes": peak}


def cpu_reference(ctx: Context, kind: str) -> dict[str, Any]:
    """The float32 CPU run every device run is compared with (made once per run)."""
    key = f"cpu_fp32:{kind}"
    if key not in ctx.cache:
        ctx.cache[key] = run(ctx, kind, "cpu", "float32")
    return ctx.cache[key]


def device_run(ctx: Context, kind: str) -> tuple[dict[str, Any], str]:
    """The device's own run without AC or compile: bf16 on CUDA, float32 on CPU (made once per run)."""
    if ctx.cuda:
        key = f"cuda_bf16:{kind}"
        if key not in ctx.cache:
            ctx.cache[key] = run(ctx, kind, "cuda", "bfloat16")
        return ctx.cache[key], "bfloat16"
    return cpu_reference(ctx, kind), "float32"


def plain_first_step(ctx: Context, kind: str) -> tuple[float, float]:
    """Loss and gradient norm of step 0 from the plain model, one unpacked sequence at a time (float32, CPU)."""
    engine = tiny.new_engine(ctx, tiny.engine_config(tiny.model_folder(ctx, kind)), "cpu")
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as folder:
        engine.export_hf(folder)
        model = models.load_hf_model(folder, dtype=torch.float32)
    batch = make_batch(0)
    total = torch.zeros(())
    for b in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][b].sum())
        ids = batch["input_ids"][b, :n]
        logp = F.log_softmax(model(ids[None])[0].float(), -1)
        token_logp = logp[:-1].gather(-1, ids[1:, None])[:, 0]
        total = total - (token_logp * batch["loss_mask"][b, 1:n]).sum()
    loss = total / batch["loss_mask"].sum()
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), norm


def check_train(ctx: Context, kind: str) -> Outcome:
    ref = cpu_reference(ctx, kind)
    plain_loss, plain_norm = plain_first_step(ctx, kind)
    first_gap = max(abs(ref["loss"][0] - plain_loss) / plain_loss, abs(ref["grad_norm"][0] - plain_norm) / plain_norm)
    if ctx.cuda:
        got, _ = device_run(ctx, kind)
        loss_tol, norm_tol, what = LOSS_TOL, GRAD_NORM_TOL, "cuda bf16"
    else:
        got = run(ctx, kind, "cpu", "float32", mb_spec={"n_mbs": 2})
        loss_tol, norm_tol, what = FP32_TOL, FP32_TOL, "cpu fp32, 2 microbatches"
    loss_gap = relative_gap(got["loss"], ref["loss"])
    norm_gap = relative_gap(got["grad_norm"], ref["grad_norm"])
    measured = {
        "step0_vs_plain": first_gap,
        "loss_gap": loss_gap,
        "grad_norm_gap": norm_gap,
        "losses": got["loss"],
        "cpu_fp32_losses": ref["loss"],
    }
    if kind == "moe" and ctx.cuda:
        measured["experts_kernel"] = experts_kernel(ctx)  # reported: which path a 1-GPU MoE step takes
    ok = first_gap <= FP32_TOL and loss_gap <= loss_tol and norm_gap <= norm_tol
    tolerance = f"step0 vs plain <= {FP32_TOL:g}; loss <= {loss_tol:g}, grad norm <= {norm_tol:g} (rel)"
    why = (
        "the engine's first step differs from the plain model's"
        if first_gap > FP32_TOL
        else f"{what} drifts from the float32 CPU run"
    )
    return judge(ok, measured, tolerance, why, note=f"{what} vs cpu fp32, {STEPS} steps")


def experts_kernel(ctx: Context) -> str:
    """'grouped_mm' or 'loop': what the MoE experts of a bf16 ``archon:d1`` train step run."""
    engine = tiny.new_engine(ctx, tiny.engine_config(tiny.model_folder(ctx, "moe"), "bfloat16"), "cuda", 1)
    ops = OpNames()
    with ops:
        tiny.train(engine, 1)
    return "grouped_mm" if any("_grouped_mm" in n for n in ops.names) else "loop"


def check_train_dense(ctx: Context) -> Outcome:
    return check_train(ctx, "dense")


def check_train_moe(ctx: Context) -> Outcome:
    return check_train(ctx, "moe")


def check_activation_checkpointing(ctx: Context) -> Outcome:
    device = ctx.device.type
    tol = AC_TOL_BF16 if ctx.cuda else FP32_TOL
    measured: dict[str, Any] = {}
    worst = 0.0
    for kind in ("dense", "moe"):
        base, dtype = device_run(ctx, kind)
        if ctx.cuda:
            measured[f"{kind}_peak_mib:none"] = round(base["peak_bytes"] / 2**20, 1)
        for mode, archon in AC_MODES.items():
            got = run(ctx, kind, device, dtype, gradient_checkpointing=True, archon=archon)
            gap = max(relative_gap(got["loss"], base["loss"]), relative_gap(got["grad_norm"], base["grad_norm"]))
            worst = max(worst, gap)
            measured[f"{kind}:{mode}"] = gap
            if ctx.cuda:
                measured[f"{kind}_peak_mib:{mode}"] = round(got["peak_bytes"] / 2**20, 1)
    return judge(worst <= tol, measured, f"loss and grad norm vs no AC <= {tol:g} (rel)")


def compile_gaps(ctx: Context, kind: str, variants: dict[str, dict[str, Any]]) -> Outcome:
    base, dtype = device_run(ctx, kind)
    measured: dict[str, Any] = {}
    worst_loss = worst_norm = 0.0
    for name, overrides in variants.items():
        # Compile pads every microbatch to max_tokens_per_mb: one graph for every packing.
        got = run(ctx, kind, ctx.device.type, dtype, mb_spec={"max_tokens_per_mb": 128}, **overrides)
        loss_gap = relative_gap(got["loss"], base["loss"])
        norm_gap = relative_gap(got["grad_norm"], base["grad_norm"])
        measured[f"{name}:loss_gap"], measured[f"{name}:grad_norm_gap"] = loss_gap, norm_gap
        worst_loss, worst_norm = max(worst_loss, loss_gap), max(worst_norm, norm_gap)
    ok = worst_loss <= LOSS_TOL and worst_norm <= GRAD_NORM_TOL
    return judge(ok, measured, f"vs eager {dtype}: loss <= {LOSS_TOL:g}, grad norm <= {GRAD_NORM_TOL:g} (rel)")


def check_compile_dense(ctx: Context) -> Outcome:
    budget = {"ac_mode": "memory_budget", "ac_memory_budget": 0.5, "enable_compile": True}
    return compile_gaps(
        ctx,
        "dense",
        {
            "compile": {"archon": {"enable_compile": True}},
            "compile+ac_budget": {"gradient_checkpointing": True, "archon": budget},
        },
    )


def check_compile_moe(ctx: Context) -> Outcome:
    return compile_gaps(ctx, "moe", {"compile": {"archon": {"enable_compile": True}}})


def count_syncs(ctx: Context, kind: str, warmup: int = 2) -> tuple[int, list[str]]:
    """Synchronizing CUDA calls in one bf16 train step after ``warmup`` steps, and where they came from."""
    engine = tiny.new_engine(ctx, tiny.engine_config(tiny.model_folder(ctx, kind), "bfloat16"), "cuda", warmup + 1)
    tiny.train(engine, warmup)
    batch = make_batch(warmup)
    torch.cuda.synchronize(ctx.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.train_batch(batch, tiny.sft_loss, tiny.sft_weight)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return len(syncs), [f"{loc} x{n}" for loc, n in where.most_common(6)]


def check_host_syncs(ctx: Context) -> Outcome:
    dense, dense_where = count_syncs(ctx, "dense")
    moe, moe_where = count_syncs(ctx, "moe")
    measured = {"dense_syncs": dense, "moe_syncs": moe, "dense_from": dense_where, "moe_from": moe_where}
    return Outcome("pass", measured, "reported, not judged (target: 1 per step)", "bf16 train step after 2 warm-up")
