"""Which transformers module plays which role of Archon's shared block: by data flow first, then by name.

A projection fills a role only when it reads what that role reads (the attention's or the MLP's
input) or writes what it writes (their output), and its name or, among those, its shape alone
singles it out; a module whose rows are several roles' rows stacked is a ``Fused`` projection,
which the generated tables cannot split.  Shape alone never decides (phi3's ``o_proj`` is as
wide as a query projection, and is none).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaffold.probe import Record, same

# Archon's parameter names inside a block, by role.
ATTN_ROLES = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo"}
MLP_ROLES = {"w1": "feed_forward.w1", "w3": "feed_forward.w3", "w2": "feed_forward.w2"}
PROJECTIONS = {**ATTN_ROLES, **MLP_ROLES}
"""Every projection role -> its Archon module path inside a block."""
NORM_ROLES = {"pre_attention": "attention_norm", "pre_mlp": "ffn_norm"}
NAME_HINTS = {
    "wq": ("q_proj", "query", "q", "wq"),
    "wk": ("k_proj", "key", "k", "wk"),
    "wv": ("v_proj", "value", "v", "wv"),
    "wo": ("o_proj", "out_proj", "dense", "o", "wo", "c_proj"),
    "w1": ("gate_proj", "gate", "w1"),
    "w3": ("up_proj", "up", "w3"),
    "w2": ("down_proj", "down", "w2"),
}


@dataclass
class Fused:
    """A transformers projection that stacks several of the shared block's projections along dim 0."""

    hf: str
    """Module path inside the block (``self_attn.qkv_proj``)."""
    roles: list[tuple[str, int, int]]
    """(role such as ``wq``, first row, rows) in the order they are stacked."""
    confirmed: bool = False
    """Whether the probe computed transformers' module with the split (else the split is a guess)."""

    def rows(self, role: str) -> str:
        start, length = next((s, n) for r, s, n in self.roles if r == role)
        return f"{start}:{start + length}"


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def name_tokens(name: str) -> set[str]:
    leaf = _leaf(name)
    return {leaf, *leaf.split("_")}


def is_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        not isinstance(module, (nn.Linear, nn.Embedding))
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and not list(module.children())
    )


def pick_by_name(
    role: str, candidates: dict[str, tuple[int, ...]], shape: tuple[int, ...], taken: set[str]
) -> str | None:
    """The candidate of ``shape`` whose name fits ``role`` (or the only one of that shape)."""
    fits = [n for n, s in candidates.items() if s == shape and n not in taken]
    named = [n for n in fits if name_tokens(n) & set(NAME_HINTS[role])]
    if len(named) == 1:
        return named[0]
    return fits[0] if len(fits) == 1 and not named else None


def linears_by_flow(
    module: nn.Module, path: str, rec: dict[str, Record]
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The linear layers of ``module`` that read its input, and those that write its output (name -> shape)."""
    inp, out = rec[path].inp, rec[path].out
    reads: dict[str, tuple[int, ...]] = {}
    writes: dict[str, tuple[int, ...]] = {}
    for name, lin in module.named_modules():
        r = rec.get(f"{path}.{name}")
        if not isinstance(lin, nn.Linear) or r is None:
            continue
        if same(r.inp, inp, 0):
            reads[name] = tuple(lin.weight.shape)
        if same(r.out, out, 0):
            writes[name] = tuple(lin.weight.shape)
    return reads, writes


def fused_split(
    name: str, shape: tuple[int, ...], missing: list[str], shapes: dict[str, tuple[int, ...]]
) -> list[tuple[str, int, int]] | None:
    """The roles ``missing`` stacked in that order along dim 0, if ``shape`` is exactly their rows together."""
    if len(missing) < 2 or any(shapes[r][1] != shape[1] for r in missing):
        return None
    if sum(shapes[r][0] for r in missing) != shape[0]:
        return None
    split, start = [], 0
    for role in missing:
        split.append((role, start, shapes[role][0]))
        start += shapes[role][0]
    return split


@torch.no_grad()
def order_gate_up_(fused: Fused, block: nn.Module, down_path: str | None, inp: torch.Tensor, out: torch.Tensor):
    """Order a fused gate/up projection's halves by the function (``down(silu(gate) * up)``), if it tells."""
    if down_path is None:
        return
    weight = cast(torch.Tensor, block.get_submodule(fused.hf).weight)
    down = block.get_submodule(down_path)
    (_, s0, n0), (_, s1, n1) = fused.roles
    first, second = F.linear(inp, weight[s0 : s0 + n0]), F.linear(inp, weight[s1 : s1 + n1])
    if same(down(F.silu(first) * second), out):
        fused.roles, fused.confirmed = [("w1", s0, n0), ("w3", s1, n1)], True
    elif same(down(F.silu(second) * first), out):
        fused.roles, fused.confirmed = [("w3", s0, n0), ("w1", s1, n1)], True


def unplaced_projections(
    block: nn.Module, attn: str, mlp: str, picked: dict[str, str], fused: list[Fused]
) -> Iterator[str]:
    """Linear layers of the attention and MLP that neither a table entry nor a fused split places."""
    placed = set(picked.values()) | {f.hf for f in fused}
    for part in (attn, mlp):
        for name, lin in block.get_submodule(part).named_modules():
            if isinstance(lin, nn.Linear) and f"{part}.{name}" not in placed:
                yield f"{part}.{name}"
