"""Grouped-query attention with packed sequences and an optional KV cache.

One module for every device: ``CoreAttention`` picks the kernel, and every kernel computes
the same function.  A packed row costs what its sequences cost (the sum of their squared
lengths, not the squared row length):

* CUDA in half precision: ``torch.nn.attention.varlen`` (FlashAttention) over the whole row.
* Elsewhere (CPU, float32): SDPA's fused causal kernel on the row's sequences regrouped by
  length into a few right-padded ``[count, length, heads, head_dim]`` batches
  (``padded_groups``: padding bounded, so the cost stays near the sum of squared lengths); a
  row of equal-length sequences is one call on a view, with no copy.  An RL batch of
  hundreds of short answers is a handful of calls rather than one per sequence.
* Under ``torch.compile`` (no varlen kernel): SDPA with the block-diagonal causal mask, whose
  shapes do not depend on the boundaries, so one graph serves every packing.
* Rows without packing use SDPA's causal path; the KV-cache path passes an explicit mask.

(FlexAttention has no CPU backward and varlen attention is CUDA-only, hence SDPA on CPU.)
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.linear import Linear
from models.common.norm import RMSNorm
from models.common.packing import PaddedGroups, packed_causal_mask, padded_groups, segment_lengths
from models.common.rope import apply_rotary_emb
from models.common.shared_prefix import SegmentLayout


def _find_varlen_attn():
    """``(varlen_attn, takes enable_gqa)`` if this torch has the API used here, else ``(None, False)``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None, False
    params = inspect.signature(varlen_attn).parameters
    if not {"scale", "window_size"} <= set(params):
        return None, False
    return varlen_attn, "enable_gqa" in params


# Looked up once at import: plain globals are free to read inside torch.compile'd blocks.
# torch 2.10-2.11's varlen_attn has no enable_gqa: grouped-query rows get their K/V heads repeated.
_VARLEN_ATTN, _VARLEN_GQA = _find_varlen_attn()


def _can_use_varlen(q: torch.Tensor) -> bool:
    # FlashAttention: CUDA, half precision only.
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _VARLEN_ATTN is not None


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA on ``[batch, seq, heads, head_dim]`` tensors: causal without ``mask``, else masked."""
    if mask is not None and not q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        # CPU's fused kernel is several times slower in low precision on masked (KV-cache)
        # steps than in float32, and the inputs are small there: compute in float32.
        return _sdpa(q.float(), k.float(), v.float(), scale, gqa, mask).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a KV-cache step: ``q [b, s, h, d]`` over ``k, v [b, t, kv, d]`` with ``mask [b, 1, s, t]``.

    A decode step (a few queries per row) is two small batched matmuls per KV head: on CPU
    they are about twice as fast as SDPA's kernel, which is built for long queries.  Longer
    steps (prefill) and CUDA use SDPA.  Low precision computes in float32 on CPU.
    """
    b, s, h, d = q.shape
    kv_heads = k.shape[2]
    if q.is_cuda or s > 4:
        return _sdpa(q, k, v, scale, h != kv_heads, mask)
    dtype = q.dtype
    if dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    group = h // kv_heads
    # Query heads j*group .. (j+1)*group-1 read KV head j: one [group*s, t] score block per KV head.
    qg = q.permute(0, 2, 1, 3).reshape(b, kv_heads, group * s, d)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).mul_(scale)
    allowed = mask.expand(b, 1, s, -1).repeat(1, 1, group, 1) if group > 1 and s > 1 else mask
    scores.masked_fill_(~allowed, float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), v.transpose(1, 2))  # [b, kv, group*s, d]
    return out.view(b, kv_heads, group, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h, d).to(dtype)


# The last row's grouping: every layer of a forward (and its recomputation) sees the same
# cu_seqlens tensor, so the host work and index tensors are made once per forward.
_LAST_GROUPING: tuple[torch.Tensor, int, list[int], PaddedGroups | None] | None = None


def _grouping(cu_seqlens: torch.Tensor, seqlen: int, device: torch.device) -> tuple[list[int], PaddedGroups | None]:
    global _LAST_GROUPING
    last = _LAST_GROUPING
    if (
        last is not None
        and last[0] is cu_seqlens
        and last[1] == seqlen
        and (last[3] is None or last[3].gather.device == device)
    ):
        return last[2], last[3]
    lengths = segment_lengths(cu_seqlens, seqlen)
    groups = padded_groups(lengths, device)
    _LAST_GROUPING = (cu_seqlens, seqlen, lengths, groups)
    return lengths, groups


class CoreAttention(nn.Module):
    """``softmax(q k^T * scale + mask) v`` on ``[batch, seq, heads, head_dim]`` tensors.

    A separate module so context parallel (Ulysses) can wrap it: its inputs and output keep
    the ``[batch, seq, heads, head_dim]`` layout.  ``k, v`` may have fewer heads than ``q``
    (grouped-query attention).  ``cu_seqlens`` refers to the full, unsharded sequence.
    ``mask`` (boolean, broadcastable to ``[batch, 1, seq_q, seq_k]``, True = may attend)
    replaces the causal/packed mask; the KV cache path passes it.  ``segments`` replaces
    ``cu_seqlens`` for a row packed with shared prefixes (``models/common/shared_prefix.py``).
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        segments: SegmentLayout | None = None,
    ) -> torch.Tensor:
        gqa = q.shape[2] != k.shape[2]
        if mask is not None:
            return attend_cached(q, k, v, mask, self.scale)
        if segments is not None:
            return self._segments(q, k, v, segments, gqa)
        if cu_seqlens is None:
            return _sdpa(q, k, v, self.scale, gqa)
        if q.is_cuda and torch.is_autocast_enabled("cuda"):
            # Autocast would hand SDPA low-precision inputs; do the same before choosing the
            # kernel, or a float32 q (after RMSNorm and RoPE) would miss FlashAttention.
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if _can_use_varlen(q):
            return self._varlen(q, k, v, cu_seqlens, max_seqlen, gqa)
        if torch.compiler.is_compiling():
            # Boundaries read on the host would specialise the graph to one packing.
            return _sdpa(q, k, v, self.scale, gqa, mask=packed_causal_mask(cu_seqlens, q.shape[1], q.device))
        return self._per_sequence(q, k, v, cu_seqlens, gqa)

    def _per_sequence(self, q, k, v, cu_seqlens, gqa) -> torch.Tensor:
        """Causal SDPA per sequence of the packed row (trailing padding included), batched by length."""
        bs, seqlen = q.shape[:2]
        assert bs == 1, "packed sequences (cu_seqlens) need batch size 1"
        lengths, groups = _grouping(cu_seqlens, seqlen, q.device)
        if groups is None:  # equal lengths: the row is a [count, length] batch as it is
            count = len(lengths)
            qb, kb, vb = (t.reshape(count, seqlen // count, *t.shape[2:]) for t in (q, k, v))
            return _sdpa(qb, kb, vb, self.scale, gqa).reshape(q.shape)
        sizes = [count * length for count, length in zip(groups.counts, groups.lengths)]
        pieces = zip(*(t[0].index_select(0, groups.gather).split(sizes) for t in (q, k, v)))
        outs = []
        for count, length, (qi, ki, vi) in zip(groups.counts, groups.lengths, pieces):
            qb, kb, vb = (t.view(count, length, *t.shape[1:]) for t in (qi, ki, vi))
            outs.append(_sdpa(qb, kb, vb, self.scale, gqa).reshape(count * length, *qi.shape[1:]))
        return torch.cat(outs).index_select(0, groups.scatter).unsqueeze(0)

    def _segments(self, q, k, v, layout: SegmentLayout, gqa: bool) -> torch.Tensor:
        """Each batch of segments attends to its context and causally to itself (``SegmentBatch.mask``, or causal
        when None); outputs back in row order."""
        assert q.shape[0] == 1, "a row packed with shared prefixes needs batch size 1"
        outs = []
        for b in layout.batches:
            qb = q[0].index_select(0, b.queries).view(b.count, b.length, *q.shape[2:])
            width = b.context_length + b.length
            kb, vb = (t[0].index_select(0, b.keys).view(b.count, width, *t.shape[2:]) for t in (k, v))
            outs.append(_sdpa(qb, kb, vb, self.scale, gqa, mask=b.mask).reshape(b.count * b.length, *q.shape[2:]))
        return torch.cat(outs).index_select(0, layout.scatter).unsqueeze(0)

    def _varlen(self, q, k, v, cu_seqlens, max_seqlen, gqa) -> torch.Tensor:
        bs, seqlen = q.shape[:2]
        assert bs == 1, "packed sequences (cu_seqlens) need batch size 1"
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        # Trailing padding is one more sequence, as on the SDPA path; when there is none the
        # appended entry is an empty sequence (as pad_cu_seqlens makes), so no host sync decides.
        cu = torch.cat([cu, cu.new_full((1,), seqlen)])  # a fill: new_tensor would copy from the host and sync
        if max_seqlen is None:  # Decoder.forward passes it (one sync per forward, not per layer)
            max_seqlen = int((cu[1:] - cu[:-1]).max())
        assert _VARLEN_ATTN is not None, "the varlen path runs only where _can_use_varlen holds"
        gqa_kwargs = {"enable_gqa": gqa} if _VARLEN_GQA else {}
        if gqa and not _VARLEN_GQA:  # one K/V head per query head, as enable_gqa would read them
            k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
        out = _VARLEN_ATTN(
            q[0], k[0], v[0], cu, cu, max_seqlen, max_seqlen, scale=self.scale, window_size=(-1, 0), **gqa_kwargs
        )
        # Without return_aux the kernel returns the output alone.
        return cast(torch.Tensor, out).unsqueeze(0)


class Attention(nn.Module):
    """Qwen attention: ``wq, wk, wv, wo`` projections, optional q/k RMSNorm over head_dim, RoPE.

    Head counts are never stored for reshapes (``view(..., -1, head_dim)``), so tensor
    parallel can shard ``wq/wk/wv`` column-wise and ``wo`` row-wise without model changes.
    """

    def __init__(
        self,
        layer_id: int,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = head_dim
        self.wq = Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.wk = Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = Linear(n_heads * head_dim, dim, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.core = CoreAttention(scale=head_dim**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: torch.Tensor | None = None,
        cache: Any = None,
        max_seqlen: int | None = None,
        segments: SegmentLayout | None = None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            assert self.k_norm is not None, "q_norm and k_norm are built together (qk_norm)"
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = apply_rotary_emb(q, k, *rope_cos_sin)

        mask = None
        if cache is not None:
            # Duck-typed KV cache: returns keys/values of every cached position and the
            # boolean mask [batch, 1, seq_new, seq_total] (True = may attend).
            k, v, mask = cache.update(self.layer_id, k, v)
        # Passed only when set: context parallel's wrapper of the core takes no segments (refused with them).
        extra = {"segments": segments} if segments is not None else {}
        out = self.core(q, k, v, cu_seqlens=cu_seqlens, mask=mask, max_seqlen=max_seqlen, **extra)
        return self.wo(out.reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.normal_(linear.weight, mean=0.0, std=init_std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()
