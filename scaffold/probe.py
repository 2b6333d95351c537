"""Probing a transformers causal LM and an Archon decoder side by side, one module at a time.

Both models hold the same weights (the Archon one loaded from the transformers one's
checkpoint).  A forward of the transformers model on a fixed row of tokens records what
every module received and returned; each check then runs the matching Archon module on the
same input and compares.  ``scripts/add_model.py`` uses the checks to find what differs from
``models/common`` (and so what its report lists), and the parity test it writes runs the
same checks against the generated package, so each listed point fails until implemented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from models.state_dict_adapter import UnknownKeyError

TOKENS = 12
"""Length of the probe row."""


@dataclass
class Record:
    """What one module received (its hidden-state input) and returned, in the probe forward."""

    inp: torch.Tensor | None
    out: torch.Tensor | None


@dataclass
class Trace:
    """Module inputs and outputs of one forward of a transformers model, by module path."""

    ids: torch.Tensor
    """[1, TOKENS] token ids."""
    records: dict[str, Record] = field(default_factory=dict)
    """Module path -> its first call's input and output."""
    logits: torch.Tensor | None = None


def probe_ids(vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(seed))


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    for name in ("last_hidden_state", "logits"):
        if isinstance(getattr(value, name, None), torch.Tensor):
            return getattr(value, name)
    return None


@torch.no_grad()
def trace(model: nn.Module, ids: torch.Tensor) -> Trace:
    """Run ``model(input_ids=ids)`` recording every module's hidden-state input and output."""
    result = Trace(ids)
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(mod, args, kwargs, output, name=name):
            if name in result.records:
                return
            inp = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            out = _first_tensor(output)
            result.records[name] = Record(
                inp.detach().clone() if isinstance(inp, torch.Tensor) else None,
                out.detach().clone() if out is not None else None,
            )

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        result.logits = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        for h in handles:
            h.remove()
    return result


def same(a: torch.Tensor | None, b: torch.Tensor | None, tol: float = 1e-5) -> bool:
    """Equal shapes and values within ``tol`` relative to the larger magnitude."""
    if a is None or b is None or a.shape != b.shape:
        return False
    scale = max(float(a.abs().max()), float(b.abs().max()), 1.0)
    return float((a.float() - b.float()).abs().max()) <= tol * scale


def max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return "missing"
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    return f"max |diff| {float((a.float() - b.float()).abs().max()):.3g}"


# ------------------------------------------------------------------------------ the checks
@dataclass(frozen=True)
class Point:
    """One thing that must compute the same in both models; ``check`` says whether it does.

    ``kind``: ``norm`` (an Archon norm vs the transformers norm in that role), ``embedding``
    (the input of the first block), ``mlp``, ``attention``, ``block`` (block 0 as a whole),
    ``residual`` (block 0's residual adds, fed transformers' own attention and MLP outputs),
    ``head`` (the LM head on the output of transformers' final norm), ``logits``,
    ``hf_param`` (a transformers parameter the Archon adapter must map) or ``archon_param``
    (an Archon parameter that no checkpoint key fills).
    """

    kind: str
    archon: str = ""
    """Archon module path or parameter name (for ``norm``, ``archon_param``)."""
    hf: str = ""
    """transformers module path or parameter name (for ``norm``, ``mlp``, ``attention``, ``block``, ``hf_param``)."""
    what: str = ""
    """The difference in words (the report line and the failure message)."""
    parts: tuple[str, ...] = ()
    """transformers module paths a check needs besides ``hf`` (``residual``: the attention and the MLP)."""

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.archon or self.hf}" if (self.archon or self.hf) else self.kind


def check(
    point: Point, hf_model: nn.Module, archon_model: nn.Module, hf_trace: Trace, adapter: Any = None
) -> str | None:
    """None when ``point`` computes the same in both models, else what differs."""
    return _CHECKS[point.kind](point, hf_model, archon_model, hf_trace, adapter)


def _archon_trace(archon_model: nn.Module, ids: torch.Tensor) -> dict[str, Record]:
    records: dict[str, Record] = {}
    handles = []
    for name, module in archon_model.named_modules():

        def hook(mod, args, output, name=name):
            if name not in records:
                records[name] = Record(
                    args[0].detach().clone() if args and isinstance(args[0], torch.Tensor) else None,
                    _first_tensor(output),
                )

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            archon_model(ids)
    finally:
        for h in handles:
            h.remove()
    return records


@torch.no_grad()
def _check_norm(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    rec = hf_trace.records.get(point.hf)
    module = archon_model.get_submodule(point.archon) if _has(archon_model, point.archon) else None
    if rec is None or module is None:
        return f"no module {point.archon!r} in the Archon model" if module is None else "not reached"
    got = module(rec.inp)
    return None if same(got, rec.out) else max_diff(got, rec.out)


@torch.no_grad()
def _check_embedding(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    first_block = hf_trace.records.get(point.hf)
    ours = _archon_trace(archon_model, hf_trace.ids).get("layers.0")
    if first_block is None or ours is None:
        return "not reached"
    return None if same(ours.inp, first_block.inp) else max_diff(ours.inp, first_block.inp)


def _reached(hf_trace: Trace, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Input and output of a module the analysis saw the probe forward feed a hidden state."""
    rec = hf_trace.records.get(path)
    assert rec is not None and rec.inp is not None, f"the probe forward fed no hidden state to {path!r}"
    return rec.inp, rec.out


@torch.no_grad()
def _check_mlp(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    inp, out = _reached(hf_trace, point.hf)
    got = archon_model.layers["0"].feed_forward(inp)
    return None if same(got, out) else max_diff(got, out)


@torch.no_grad()
def _check_attention(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    inp, out = _reached(hf_trace, point.hf)
    positions = torch.arange(inp.shape[1]).unsqueeze(0)
    got = archon_model.layers["0"].attention(inp, archon_model.rope(positions, inp.dtype))
    return None if same(got, out) else max_diff(got, out)


@torch.no_grad()
def _check_block(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    inp, out = _reached(hf_trace, point.hf)
    positions = torch.arange(inp.shape[1]).unsqueeze(0)
    got = archon_model.layers["0"](inp, archon_model.rope(positions, inp.dtype))
    return None if same(got, out) else max_diff(got, out)


@torch.no_grad()
def _check_residual(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    inp, out = _reached(hf_trace, point.hf)
    attn_out, mlp_out = (_reached(hf_trace, path)[1] for path in point.parts)
    block = archon_model.layers["0"]
    # Archon's attention and MLP return transformers' outputs: only the adds around them are compared.
    handles = [
        block.attention.register_forward_hook(lambda mod, args, output: attn_out),
        block.feed_forward.register_forward_hook(lambda mod, args, output: mlp_out),
    ]
    try:
        positions = torch.arange(inp.shape[1]).unsqueeze(0)
        got = block(inp, archon_model.rope(positions, inp.dtype))
    finally:
        for h in handles:
            h.remove()
    return None if same(got, out) else max_diff(got, out)


@torch.no_grad()
def _check_head(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    _, normed = _reached(hf_trace, point.hf)
    got = archon_model.output(normed).float()
    return None if same(got, hf_trace.logits, tol=1e-4) else max_diff(got, hf_trace.logits)


@torch.no_grad()
def _check_logits(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    got = archon_model(hf_trace.ids).float()
    return None if same(got, hf_trace.logits, tol=1e-4) else max_diff(got, hf_trace.logits)


def _check_hf_param(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    try:
        targets = adapter.hf_key_targets(point.hf)
    except UnknownKeyError:
        return "the Archon adapter does not map it"
    names = dict(archon_model.named_parameters())
    missing = [t.name for t in targets if t.name not in names]
    return f"it maps to {missing}, which the model lacks" if missing or not targets else None


def _check_archon_param(point: Point, hf_model, archon_model, hf_trace: Trace, adapter) -> str | None:
    if point.archon not in dict(archon_model.named_parameters()):
        return None  # the implementation dropped it
    for hf_name in hf_model.state_dict():
        try:
            if any(t.name == point.archon for t in adapter.hf_key_targets(hf_name)):
                return None
        except UnknownKeyError:
            continue
    return "no checkpoint tensor fills it"


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


_CHECKS = {
    "norm": _check_norm,
    "embedding": _check_embedding,
    "mlp": _check_mlp,
    "attention": _check_attention,
    "block": _check_block,
    "residual": _check_residual,
    "head": _check_head,
    "logits": _check_logits,
    "hf_param": _check_hf_param,
    "archon_param": _check_archon_param,
}
