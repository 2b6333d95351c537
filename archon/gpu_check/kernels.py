"""Kernel rows: packed attention and MoE experts against float64 references written here.

* ``packed_attention`` (any device, float32): ``CoreAttention`` on one packed row (uneven
  lengths, a one-token sequence, empty sequences from repeated ``cu_seqlens`` entries, trailing
  padding, a row of equal lengths) against causal attention computed per sequence in float64.
* ``varlen_attention`` (CUDA, bfloat16): the same rows where Archon takes FlashAttention's
  varlen kernel; the kernel must really run (seen by a dispatch mode) and agree.
* ``experts_loop`` (any device, float32): ``GroupedExperts`` with the per-expert loop on uneven
  and empty groups and alignment padding, against a float64 per-expert SwiGLU.
* ``grouped_gemm`` (CUDA sm90+, bfloat16): the same groups with bfloat16 weights and input (what
  FSDP's mixed precision hands the experts): the module must pick the grouped GEMM, and agree.

Errors are ``max |got - ref| / max |ref|`` over values and the gradients of every input, the
reference being computed from the very inputs the kernel saw (rounded to its dtype first), so
only the kernel's own arithmetic counts.  Tolerances: float32 1e-5 (measured ~5e-7 on CPU);
bfloat16 values 2e-2 and gradients 3e-2: the unit roundoff is 3.9e-3 and the output, the
SwiGLU intermediate and (backward) the upstream gradient are each rounded; the per-expert loop
in bfloat16 measures 7e-3 / 8e-3 on CPU.  The mistakes these rows exist for (a token reaching
the wrong expert or sequence, an empty group shifting the rest) are errors of order 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from archon.gpu_check.environment import varlen_api
from archon.gpu_check.table import Context, Outcome, judge, skip
from models.common.attention import CoreAttention
from models.common.moe import GroupedExperts
from models.common.packing import pad_cu_seqlens

FP32_TOL = 1e-5
BF16_TOL = 2e-2
BF16_GRAD_TOL = 3e-2

# (segment lengths, trailing padding tokens, extra empty sequences appended to cu_seqlens)
ATTENTION_ROWS: dict[str, tuple[list[int], int, int]] = {
    "uneven_empty_padded": ([5, 1, 0, 12, 7, 0, 7, 3], 4, 2),
    "equal_lengths": ([8, 8, 8], 0, 0),
    "one_sequence": ([19], 0, 0),
}
N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 32

# Tokens per expert (6 experts); the padded case adds rows past sum(counts) that must come out zero.
EXPERT_GROUPS: dict[str, tuple[list[int], int]] = {
    "uneven_empty": ([5, 0, 13, 1, 0, 9], 0),
    "ends_empty": ([0, 8, 8, 3, 5, 0], 0),
    "one_expert": ([0, 0, 24, 0, 0, 0], 0),
    "padded": ([4, 0, 6, 2, 0, 3], 5),
}
DIM, EXPERT_HIDDEN = 64, 32


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|`` in float64 (0 for two zero tensors)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------- attention


def packed_row(lengths: list[int], padding: int, empties: int) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32, row length)`` of sequences of ``lengths`` then ``padding`` tokens."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32)
    return pad_cu_seqlens(cu, cu.numel() + empties), bounds[-1] + padding


def record_errors(
    worst: dict[str, float],
    out: torch.Tensor,
    leaves: list[torch.Tensor],
    reference: Callable[..., torch.Tensor],
    grad_out: torch.Tensor,
) -> None:
    """Raise ``worst``'s output and gradient errors to those of ``out`` (backpropagated already) and its ``leaves``
    against ``reference`` run in float64 on the same leaves with the same output gradient."""
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference(*ref_leaves)
    ref.backward(grad_out.double())
    worst["out_err"] = max(worst["out_err"], relative_error(out, ref))
    for got, want in zip(leaves, ref_leaves):
        assert got.grad is not None and want.grad is not None
        worst["grad_err"] = max(worst["grad_err"], relative_error(got.grad, want.grad))


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, seqlen: int, scale: float
) -> torch.Tensor:
    """Causal softmax attention of each sequence on its own (trailing padding as one more), float64."""
    bounds = sorted(set(cu.tolist()) | {seqlen})
    group = q.shape[2] // k.shape[2]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[0, start:end].double().transpose(0, 1) for t in (q, k, v))  # [heads, len, dim]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs).unsqueeze(0)


def attention_errors(device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple[dict[str, Any], set[str]]:
    """Worst value and gradient errors of ``CoreAttention`` over ``ATTENTION_ROWS``, and the ops that ran."""
    attn = CoreAttention(scale=HEAD_DIM**-0.5)
    gen = torch.Generator().manual_seed(seed)
    worst = {"out_err": 0.0, "grad_err": 0.0}
    ops = OpNames()
    for lengths, padding, empties in ATTENTION_ROWS.values():
        cu, seqlen = packed_row(lengths, padding, empties)
        shapes = [(1, seqlen, N_HEADS, HEAD_DIM), (1, seqlen, N_KV_HEADS, HEAD_DIM), (1, seqlen, N_KV_HEADS, HEAD_DIM)]
        leaves = [torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in shapes]
        grad_out = torch.randn(shapes[0], generator=gen).to(device, dtype)
        with ops:
            out = attn(*leaves, cu_seqlens=cu.to(device), max_seqlen=max(lengths + [padding]))
            out.backward(grad_out)
        reference = functools.partial(reference_attention, cu=cu, seqlen=seqlen, scale=attn.scale)
        record_errors(worst, out, leaves, reference, grad_out)
    return worst, ops.names


def check_packed_attention(ctx: Context) -> Outcome:
    errs, _ = attention_errors(ctx.device, torch.float32)
    ok = errs["out_err"] <= FP32_TOL and errs["grad_err"] <= FP32_TOL
    note = f"float32 on {ctx.device.type}: per-length SDPA batches" + (" (varlen is half precision only)" * ctx.cuda)
    return judge(ok, errs, f"rel err <= {FP32_TOL:g}", note=note)


def check_varlen_attention(ctx: Context) -> Outcome:
    api = varlen_api()
    if not api.startswith("ok"):
        return skip(f"varlen attention API {api}", {"varlen_api": api})
    errs, ops = attention_errors(ctx.device, torch.bfloat16)
    kernels = sorted(n for n in ops if "varlen" in n or "flash" in n or "attention" in n)
    measured: dict[str, Any] = {**errs, "attention_ops": kernels}
    used = any("varlen" in n for n in ops)
    ok = used and errs["out_err"] <= BF16_TOL and errs["grad_err"] <= BF16_GRAD_TOL
    why = f"errors over {BF16_TOL:g} / {BF16_GRAD_TOL:g}"
    if not used:
        why = "bf16 packed rows did not run the varlen kernel"
    return judge(ok, measured, f"varlen op ran; rel err <= {BF16_TOL:g} (grads {BF16_GRAD_TOL:g})", why)


# ---------------------------------------------------------------------------------- experts


def reference_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: list[int]):
    """Each expert's SwiGLU on its slice of ``x`` in float64; rows past ``sum(counts)`` are zero."""
    outs = []
    start = 0
    for e, n in enumerate(counts):
        xe = x[start : start + n]
        outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += n
    outs.append(x.new_zeros(x.shape[0] - start, x.shape[1]))
    return torch.cat(outs)


def experts_errors(
    device: torch.device,
    dtype: torch.dtype,
    use_grouped_mm: bool | None,
    groups: dict[str, tuple[list[int], int]],
    seed: int = 0,
) -> tuple[dict[str, float], set[str]]:
    """Worst value and gradient errors of ``GroupedExperts`` (weights and input in ``dtype``, as FSDP's
    mixed precision hands them over) over ``groups``, and the ops that ran."""
    gen = torch.Generator().manual_seed(seed)
    worst = {"out_err": 0.0, "grad_err": 0.0}
    ops = OpNames()
    for counts, padding in groups.values():
        n_tokens = sum(counts) + padding
        experts = GroupedExperts(DIM, EXPERT_HIDDEN, len(counts), use_grouped_mm=use_grouped_mm)
        with torch.no_grad():
            for w in (experts.w1, experts.w2, experts.w3):
                w.copy_(torch.randn(w.shape, generator=gen) / w.shape[-1] ** 0.5)
        experts = experts.to(device, dtype)
        x = torch.randn(n_tokens, DIM, generator=gen).to(device, dtype).requires_grad_()
        grad_out = torch.randn(n_tokens, DIM, generator=gen).to(device, dtype)
        with ops:
            out = experts(x, torch.tensor(counts, device=device))
            out.backward(grad_out)
        leaves = [x, experts.w1, experts.w2, experts.w3]
        record_errors(worst, out, leaves, functools.partial(reference_experts, counts=counts), grad_out)
    return worst, ops.names


def check_experts_loop(ctx: Context) -> Outcome:
    errs, _ = experts_errors(ctx.device, torch.float32, use_grouped_mm=False, groups=EXPERT_GROUPS)
    ok = errs["out_err"] <= FP32_TOL and errs["grad_err"] <= FP32_TOL
    return judge(ok, errs, f"rel err <= {FP32_TOL:g}", note="uneven, empty and padded groups, float32")


def check_grouped_gemm(ctx: Context) -> Outcome:
    cap = torch.cuda.get_device_capability(ctx.device)
    if not hasattr(torch, "_grouped_mm") or cap[0] < 9:
        return skip(f"grouped GEMM needs torch._grouped_mm and sm90+ (this is sm{cap[0]}{cap[1]})")
    # Alignment padding is the expert-parallel wrapper's (its rows are dropped): groups without it here.
    groups = {k: v for k, v in EXPERT_GROUPS.items() if v[1] == 0}
    # use_grouped_mm=None: the module picks the kernel, as in training under FSDP's bf16 parameters.
    errs, ops = experts_errors(ctx.device, torch.bfloat16, use_grouped_mm=None, groups=groups)
    used = any("_grouped_mm" in n for n in ops)
    ok = used and errs["out_err"] <= BF16_TOL and errs["grad_err"] <= BF16_GRAD_TOL
    why = "bf16 experts on sm90+ did not pick the grouped GEMM" if not used else "errors over tolerance"
    return judge(
        ok,
        {**errs, "grouped_mm_ran": used},
        f"grouped GEMM ran; rel err <= {BF16_TOL:g} (grads {BF16_GRAD_TOL:g})",
        why,
    )
