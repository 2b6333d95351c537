"""Context parallel, Ulysses style: the sequence is split over ``cp`` ranks; attention trades it for heads.

Every CP rank holds one contiguous chunk of the packed row: its tokens, its positions and
every activation ``[batch, seq/cp, ...]``.  Everything except attention acts token by token,
so only attention needs the other chunks.  ``UlyssesAttention`` wraps an attention core
(``core(q, k, v, cu_seqlens=..., max_seqlen=...)`` on ``[batch, seq, heads, head_dim]``)::

    q, k, v  [b, s/cp, h, d]  --all-to-all over cp-->  [b, s, h/cp, d]   every token, h/cp heads
    out = core(q, k, v, cu_seqlens)                    cu_seqlens of the full, unsharded row
    out      [b, s, h/cp, d]  --all-to-all over cp-->  [b, s/cp, h, d]   back to this rank's chunk

``h`` is the head count this rank holds (after tensor parallel: ``n_heads / tp``), so query
heads must divide by ``tp * cp``.  RoPE has already been applied with the positions of this
rank's chunk, so nothing inside the core changes.

Grouped-query attention: query head ``j`` reads KV head ``j // (h_q / h_kv)``.  When the local
KV heads divide by ``cp``, rank ``r`` receives KV heads ``[r*h_kv/cp, (r+1)*h_kv/cp)``, exactly
the ones its query heads ``[r*h_q/cp, (r+1)*h_q/cp)`` read.  When they do not (2 KV heads
under ``t2c2`` leave 1 per TP rank), each KV head is repeated ``cp / gcd(h_kv, cp)`` times
(``repeat_interleave``, which keeps the query->KV mapping) before the exchange; the
repetition costs KV communication only, and autograd sums the copies' gradients.

The engine shards its inputs with ``shard_sequence`` and brings per-token outputs back to
full rows with ``gather_sequence``, whose backward keeps this rank's slice of the gradient:
every CP rank computes the same loss from the same full rows, so each chunk must receive its
gradient once, not ``cp`` times (an all-gather whose backward reduce-scatters would sum the
``cp`` identical copies).  FSDP then sums the chunks' parameter gradients over ``dp_shard*cp``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from parallel.errors import ParallelConfigError


def check_heads_divisible(n_heads: int, tp: int, cp: int, model_name: str) -> None:
    """Raise a clear error when query heads cannot be split over ``tp * cp`` ranks."""
    if n_heads % (tp * cp):
        raise ParallelConfigError(
            f"{model_name}: num_attention_heads={n_heads} is not divisible by tensor x context "
            f"parallel t{tp} x c{cp} = {tp * cp}; Ulysses context parallel gives every rank "
            f"whole heads, so choose t*c from the divisors of {n_heads}"
        )


def kv_repeats_for_cp(q_heads: int, kv_heads: int, cp: int) -> int:
    """How often each local KV head is repeated so that ``cp`` ranks can split KV heads like query heads.

    Raises when the local query heads do not divide by ``cp``.
    """
    if q_heads % cp:
        raise ParallelConfigError(
            f"Ulysses context parallel over c{cp} ranks needs the local query heads ({q_heads}, after "
            f"tensor parallel) to divide by {cp}; choose t*c from the divisors of the head count"
        )
    return cp // math.gcd(kv_heads, cp)


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """Send ``x[i]`` to rank ``i`` of ``group``; the result's ``[i]`` came from rank ``i`` (autograd-aware)."""
    splits = [x.shape[0] // cp] * cp
    return all_to_all_single_autograd(x.contiguous(), splits, splits, group)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """``[b, s/cp, h, d]`` (this rank's chunk, all heads) -> ``[b, s, h/cp, d]`` (all chunks, this rank's heads)."""
    b, s_local, h, d = x.shape
    x = x.reshape(b, s_local, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp (head group), b, s/cp, h/cp, d]
    x = _all_to_all(x, group, cp)  # [cp (sequence chunk), b, s/cp, h/cp, d]
    return x.permute(1, 0, 2, 3, 4).reshape(b, cp * s_local, h // cp, d)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """``[b, s, h/cp, d]`` -> ``[b, s/cp, h, d]``: the inverse of ``sequence_to_heads``."""
    b, s, h_local, d = x.shape
    x = x.reshape(b, cp, s // cp, h_local, d).permute(1, 0, 2, 3, 4)  # [cp (sequence chunk), b, s/cp, h/cp, d]
    x = _all_to_all(x, group, cp)  # [cp (head group), b, s/cp, h/cp, d]
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * h_local, d)


class UlyssesAttention(nn.Module):
    """Runs ``core`` over the full sequence for ``1/cp`` of the heads (see the module docstring).

    Takes and returns this rank's sequence chunk ``[batch, seq/cp, heads, head_dim]``;
    ``cu_seqlens`` and ``max_seqlen`` describe the full row and are handed to ``core`` as is.
    """

    def __init__(self, core: nn.Module, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.core = core
        self.cp = cp_mesh.size()
        self.group = cp_mesh.get_group()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        if mask is not None:
            raise ValueError(
                "context parallel attention takes cu_seqlens (or a causal row), not an explicit mask "
                "(KV-cache decoding); run generation without context parallel"
            )
        repeats = kv_repeats_for_cp(q.shape[2], k.shape[2], self.cp)
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=2)
            v = v.repeat_interleave(repeats, dim=2)
        q, k, v = (sequence_to_heads(t, self.group, self.cp) for t in (q, k, v))
        out = self.core(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return heads_to_sequence(out, self.group, self.cp)

    def extra_repr(self) -> str:
        return f"cp={self.cp}"


def apply_cp(blocks: nn.ModuleDict, cp_mesh: DeviceMesh, core: str) -> None:
    """Wrap the attention core of every block (``block.get_submodule(core)``) in ``UlyssesAttention``.

    The core holds no parameters, so parameter names do not change.  Apply after tensor
    parallel (the core then sees the local heads) and before activation checkpointing,
    compile and FSDP wrap the blocks.
    """
    for block in blocks.values():
        block.set_submodule(core, UlyssesAttention(block.get_submodule(core), cp_mesh))


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim``; the backward keeps this rank's slice (no sum over ranks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        chunks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, x.contiguous(), group=group)
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def shard_sequence(x: torch.Tensor, cp_mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """This CP rank's contiguous chunk of ``x`` along ``dim`` (its length must divide by cp)."""
    cp = cp_mesh.size()
    if x.shape[dim] % cp:
        raise ValueError(
            f"a sequence of {x.shape[dim]} tokens cannot be split evenly over c{cp} ranks; pad packed "
            f"rows to a multiple of the context-parallel size"
        )
    return x.chunk(cp, dim=dim)[cp_mesh.get_local_rank()]


def gather_sequence(x: torch.Tensor, cp_mesh: DeviceMesh, dim: int = 0) -> torch.Tensor:
    """The full sequence from every CP rank's chunk, identical on all of them.

    The gradient of the result reaches this rank's chunk once: use it where every CP rank
    computes the same loss from the gathered values.
    """
    return _GatherSequence.apply(x, cp_mesh.get_group(), dim)
