"""The report's words for each difference the probes find: what differs, and the config value behind it.

Each explanation tries the usual variants on the probe's recorded tensors (a ``(1 + weight)``
RMSNorm, a LayerNorm, a constant factor on the embedding, the residual branches or the logits,
another attention scale) and names the config key whose value is the factor found.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaffold.probe import Point, same
from scaffold.roles import PROJECTIONS, Fused

_SHORT = {"wq": "q", "wk": "k", "wv": "v", "w1": "gate", "w3": "up"}


def fused_why(f: Fused) -> str:
    """A fused projection: which rows are which role, whether the probe confirmed it, and the hand edit it needs."""
    parts = ", ".join(f"rows {f.rows(role)} -> {PROJECTIONS[role]}" for role, _, _ in f.roles)
    names = [_SHORT[role] for role, _, _ in f.roles]
    how = (
        "the probe computed transformers' module with this split"
        if f.confirmed
        else "a guess from the shapes that the probe could not confirm, as the module differs for other reasons too"
    )
    return (
        f"fused projection '{f.hf}' stacks {', '.join(names[:-1])} and {names[-1]} along dim 0 ({parts}; {how}). "
        "The generated table adapter maps one checkpoint tensor to one Archon tensor, so split it by hand in "
        "state_dict_adapter.py: when loading, hf_key_targets returns one HFKeyTarget(name, None, (0, first_row, "
        "rows)) per part; when saving, to_hf_tensors gets one Archon tensor at a time and must return the parts "
        "stacked back into this one tensor"
    )


def missing_why(name: str) -> str:
    if name.endswith("attention_norm.weight"):
        return (
            "no norm before attention: transformers' block feeds its input to attention directly, the shared "
            "block normalises it first (attention_norm)"
        )
    if name.endswith("ffn_norm.weight"):
        return (
            "no norm before the MLP: transformers' block feeds the residual stream to the MLP directly, the "
            "shared block normalises it first (ffn_norm)"
        )
    if name == "norm.weight":
        return "no final norm after the last block (the shared decoder has one)"
    return f"no transformers parameter fills '{name}'"


@torch.no_grad()
def norm_why(path: str, hf, trace, ours: nn.Module) -> str:
    module = hf.get_submodule(path)
    rec = trace.records[path]
    w = module.weight.float()
    eps = next((getattr(module, a) for a in ("eps", "variance_epsilon", "epsilon") if hasattr(module, a)), 1e-6)
    u = rec.inp.float()
    rms = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
    if same((rms * (1.0 + w)).to(rec.out.dtype), rec.out):
        return f"norm '{path}' is an RMSNorm that scales by (1 + weight) (a zero-centred weight, as in Gemma)"
    if same(F.layer_norm(u, (u.shape[-1],), w, getattr(module, "bias", None), eps), rec.out):
        return f"norm '{path}' is a LayerNorm (it subtracts the mean), not an RMSNorm"
    return f"norm '{path}' ({type(module).__name__}) computes a different normalisation"


def _config_keys_of(config: Any, value: float) -> list[str]:
    """Float config keys whose value is ``value`` (what a multiplier found by the probe is called)."""
    return sorted(
        k
        for k, v in config.to_dict().items()
        if isinstance(v, float) and abs(v - value) <= 1e-4 * max(abs(value), 1e-6)
    )


def _factor(c: float, config: Any, sqrt_d: float | None = None) -> str:
    """The factor in words (``multiplied by c`` or ``divided by 1/c``) with the config key or formula it comes from."""
    inverse = _config_keys_of(config, 1.0 / c) if c and abs(c) < 1 else []
    if inverse:
        return f"divided by {1.0 / c:.4g} ({', '.join(f'{k} = {1.0 / c:.4g}' for k in inverse)})"
    names = [f"{k} = {c:.4g}" for k in _config_keys_of(config, c)]
    if sqrt_d is not None and abs(c - sqrt_d) < 1e-3 * sqrt_d:
        names.append(f"sqrt(hidden_size) = {sqrt_d:.4g}")
    return f"multiplied by {c:.4g}" + (f" ({', '.join(names)})" if names else "")


def _ratio(ours: torch.Tensor, theirs: torch.Tensor) -> float | None:
    """The constant ``c`` with ``theirs == c * ours`` (within 1e-4), if there is one."""
    c = float((theirs / ours.where(ours.abs() > 1e-6, torch.ones_like(ours))).flatten().median())
    return c if same(ours * c, theirs, 1e-4) else None


@torch.no_grad()
def attention_scale(hf, trace, archon, path: str) -> str | None:
    """Which config value scales the attention scores, if the shared attention matches with it instead of 1/sqrt(d)."""
    rec = trace.records[path]
    attention = archon.layers["0"].attention
    default = attention.core.scale
    rope = archon.rope(torch.arange(rec.inp.shape[1]).unsqueeze(0), rec.inp.dtype)
    hints = ("attn", "attention", "scal", "query")
    items = sorted(hf.config.to_dict().items(), key=lambda kv: (not any(t in kv[0] for t in hints), kv[0]))
    for key, value in items:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            continue
        if not isinstance(value, float) and key != "query_pre_attn_scalar":
            continue  # sizes and ids are no scales
        for scale, how in ((float(value), f"{key} = {value:.4g}"), (value**-0.5, f"1/sqrt({key}) = {value**-0.5:.4g}")):
            attention.core.scale = scale
            try:
                matches = same(attention(rec.inp, rope), rec.out)
            finally:
                attention.core.scale = default
            if matches:
                return (
                    f"the attention scores are scaled by {how}, where the shared attention uses "
                    f"1/sqrt(head_dim) = {default:.4g}"
                )
    return None


@torch.no_grad()
def explain_point(point: Point, hf, trace, archon) -> str:
    """What differs at a failing ``embedding``, ``mlp``, ``attention``, ``residual`` or ``head`` point."""
    config = hf.config
    if point.kind == "embedding":
        block_in = trace.records[point.hf].inp
        # A plain lookup of the embedding matrix, which is all the shared decoder does.
        lookup = F.embedding(trace.ids, hf.get_input_embeddings().weight)
        c = _ratio(lookup, block_in)
        if c is not None:
            return f"the embedding output is {_factor(c, config, math.sqrt(config.hidden_size))} before the first block"
        return "the embedding output is transformed before the first block"
    if point.kind == "mlp":
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        if act and act not in ("silu", "swish"):
            return f"activation {act!r} in the gated MLP, where the shared one uses SiLU"
        return "the MLP computes a different function from the shared gated SiLU MLP"
    if point.kind == "attention":
        scaled = attention_scale(hf, trace, archon, point.hf)
        if scaled:
            return scaled
        hints = ("attn", "attention", "scal", "rope", "rotary")
        keys = sorted(k for k, v in config.to_dict().items() if any(t in k for t in hints) and v not in (None, False))
        return "attention computes a different function from the shared one on the same weights" + (
            f" (config keys to look at: {', '.join(keys)})" if keys else ""
        )
    if point.kind == "residual":
        x, out = trace.records[point.hf].inp, trace.records[point.hf].out
        attn_out, mlp_out = (trace.records[p].out for p in point.parts)
        branches = attn_out + mlp_out
        c = _ratio(branches, out - x)
        if c is not None:
            return (
                f"the attention and MLP outputs are {_factor(c, config)} before each residual add, "
                "where the shared block adds them as they are"
            )
        return "the block adds its attention and MLP outputs to the residual stream differently from the shared block"
    if point.kind == "head":
        c = _ratio(archon.output(trace.records[point.hf].out).float(), trace.logits)
        if c is not None:
            return f"the logits are {_factor(c, config)} after the LM head"
        return "the LM head computes other logits from the final norm's output (a transform of the logits)"
    return point.kind
