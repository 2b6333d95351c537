"""A lean inference forward of ``Decoder`` for generation: the same function, fewer kernels.

A decode step works on one token per row, so its matmuls are small and the rest of the
forward (a dozen module calls and some sixty small kernels per block, microseconds each)
costs as much as they do.  ``InferenceForward`` computes what ``Decoder.forward(tokens,
positions, cache=cache)`` computes, with:

* one matmul for q, k, v and one for the gate and up projections: their weights are moved
  into one buffer per block, and the module Parameters become views of it, so weight updates
  (which copy into the Parameters in place) keep the fused weights current.  ``fuse=False``
  leaves the Parameters alone (a model that is also trained: its optimizer holds them) and runs
  one matmul per projection;
* on CPU in float32, oneDNN weights packed for small batches (``PackedLinear``: re-packed
  when a weight's version counter shows an in-place update) and residual adds fused into
  the output projections;
* queries and keys normalised and rotated together, RoPE as ``x * cos + roll(x) * signed_sin``;
* normalisation and LM head only for the positions whose logits are asked for (the last
  token of each row), as ``logits_to_keep`` does in transformers;
* no ``nn.Module`` calls except for MoE blocks.

Low precision keeps the model's order of roundings (RMSNorm in float32, cast, then weight;
the residual added after the matmul's rounding), so its results equal ``Decoder.forward``'s
bit for bit; float32 agrees to ~1e-6.  ``InferenceForward.for_model(model)`` returns None for
a model it cannot run this way (not a plain ``Decoder``, hooks, DTensors, a wrapped attention
core); callers then use the model.
"""

from __future__ import annotations

from typing import Any, TypeGuard, overload

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.attention import Attention, CoreAttention, attend_cached
from models.common.decoder import Decoder, TransformerBlock
from models.common.feed_forward import FeedForward
from models.common.linear import Linear, PackedLinear
from models.common.norm import RMSNorm


def _fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``[sum(out), in]`` weight (and bias) holding ``linears``' weights; theirs become views of it."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.detach() for lin in linears])
    start = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


def _rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    weight, eps = norm
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if x.dtype == torch.float32:  # one weight row per head
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


@overload
def _norm(module: RMSNorm) -> tuple[torch.Tensor, float]: ...
@overload
def _norm(module: RMSNorm | None) -> tuple[torch.Tensor, float] | None: ...
def _norm(module: RMSNorm | None) -> tuple[torch.Tensor, float] | None:
    return None if module is None else (module.weight, module.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # rotate_half(x) * sin == roll(x, d/2) * [-sin_lo, sin_hi]: the sign moves onto sin (exact).
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class _Joined:
    """Linears applied to one input, outputs concatenated: a fused projection without moving the weights."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.parts = [PackedLinear(lin.weight, lin.bias) for lin in linears]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def reset(self) -> None:
        for part in self.parts:
            part.reset()


class _Block:
    """One block's fused weights and the tensors and settings its forward reads (no module lookups)."""

    def __init__(self, block: TransformerBlock, fuse: bool = True) -> None:
        attn = block.attention
        self.layer_id = attn.layer_id
        self.head_dim = attn.head_dim
        self.scale = attn.core.scale
        self.n_q, self.n_kv = attn.wq.out_features, attn.wk.out_features
        qkv: list[nn.Linear] = [attn.wq, attn.wk, attn.wv]
        self.qkv = PackedLinear(*_fuse_linears(qkv)) if fuse else _Joined(qkv)
        self.moe = block.moe if block.moe_enabled else None
        if self.moe is None:
            gate_up: list[nn.Linear] = [block.feed_forward.w1, block.feed_forward.w3]
            self.gate_up = PackedLinear(_fuse_linears(gate_up)[0]) if fuse else _Joined(gate_up)
            self.w2 = PackedLinear(block.feed_forward.w2.weight)
        # Parameters held directly: module attribute lookups cost microseconds each.
        self.attention_norm, self.ffn_norm = _norm(block.attention_norm), _norm(block.ffn_norm)
        self.q_norm, self.k_norm = _norm(attn.q_norm), _norm(attn.k_norm)
        self._qk_norm: tuple[tuple[int, int], torch.Tensor] | None = None
        self.wo = PackedLinear(attn.wo.weight, attn.wo.bias)
        self.params = _block_params(block)

    def reset(self) -> None:
        """Forget what was derived from the weights (packed matmul weights, the q/k norm rows)."""
        linears = [self.qkv, self.wo] + ([] if self.moe is not None else [self.gate_up, self.w2])
        for linear in linears:
            linear.reset()
        self._qk_norm = None

    def _qk_norm_weight(self) -> torch.Tensor:
        """q_norm's weight for every query head, then k_norm's for every KV head: one ``[heads, head_dim]``."""
        assert self.q_norm is not None and self.k_norm is not None, "called only for blocks with q/k norms"
        (qw, _), (kw, _) = self.q_norm, self.k_norm
        key = (qw._version, kw._version)
        if self._qk_norm is None or self._qk_norm[0] != key:
            d = self.head_dim
            self._qk_norm = (
                key,
                torch.cat([qw.detach().expand(self.n_q // d, d), kw.detach().expand(self.n_kv // d, d)]),
            )
        return self._qk_norm[1]

    def forward(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, cache: Any) -> torch.Tensor:
        bs, seqlen, dim = h.shape
        qkv = self.qkv(_rms_norm(h, self.attention_norm))
        # Queries and keys are normalised and rotated together: heads are rows of one tensor.
        qk, v = qkv.split([self.n_q + self.n_kv, self.n_kv], dim=-1)
        qk = qk.view(bs, seqlen, -1, self.head_dim)
        v = v.view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            qk = _rms_norm(qk, (self._qk_norm_weight(), self.q_norm[1]))
        q, k = _rope(qk, cos, signed_sin).split([self.n_q // self.head_dim, self.n_kv // self.head_dim], dim=2)
        k, v, mask = cache.update(self.layer_id, k, v)
        out = attend_cached(q, k, v, mask, self.scale).reshape(bs * seqlen, -1)
        h = self.wo.add(h.reshape(bs * seqlen, dim), out)
        x = _rms_norm(h, self.ffn_norm)
        if self.moe is not None:
            h = h + self.moe(x.view(bs, seqlen, dim)).view(bs * seqlen, dim)
        else:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            h = self.w2.add(h, F.silu(gate).mul_(up))
        return h.view(bs, seqlen, dim)


def _block_params(block: TransformerBlock) -> list[nn.Parameter]:
    """The Parameters a ``_Block`` holds or fuses (MoE experts are called as a module)."""
    attn = block.attention
    params = list(attn.parameters(recurse=True))
    params += list(block.attention_norm.parameters()) + list(block.ffn_norm.parameters())
    if not block.moe_enabled:
        params += list(block.feed_forward.parameters())
    return params


class InferenceForward:
    """``Decoder.forward`` with a KV cache, for generation (see the module docstring)."""

    def __init__(self, model: Decoder, fuse: bool = True) -> None:
        self.model = model
        self.fuse = fuse
        with torch.no_grad():
            self.blocks = [_Block(block, fuse) for block in model._blocks()]
        self.output = PackedLinear(model.output.weight)

    @classmethod
    def for_model(cls, model: nn.Module, fuse: bool = True) -> InferenceForward | None:
        """The lean forward of ``model``, or None when ``model`` is not a plain single-device ``Decoder``.

        One per model and ``fuse``: fusing re-points the model's projection Parameters, so a second
        call returns the first instance (refreshed) rather than fusing again.
        """
        if not _is_plain_decoder(model):
            return None
        key = "_inference_forward" if fuse else "_inference_forward_unfused"
        existing = model.__dict__.get(key)
        if existing is not None:
            existing.refresh()
            return existing
        forward = cls(model, fuse)
        model.__dict__[key] = forward
        return forward

    def refresh(self) -> None:
        """Rebuild the blocks whose Parameters were replaced (not copied into) since.

        Weight updates that copy into the Parameters need nothing; call this after anything
        that may assign new Parameters (``load_state_dict(assign=True)``, a module swap).
        """
        with torch.no_grad():
            self.blocks = [
                b if all(x is y for x, y in zip(b.params, _block_params(block))) else _Block(block, self.fuse)
                for b, block in zip(self.blocks, self.model._blocks())
            ]
        if self.output.weight is not self.model.output.weight:
            self.output = PackedLinear(self.model.output.weight)

    def reset(self) -> None:
        """Derive everything from the weights again on the next call: they changed in place without moving their
        version counters (a fused optimizer's step on a model that is also trained)."""
        for block in self.blocks:
            block.reset()
        self.output.reset()

    @torch.no_grad()
    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, last: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[batch, vocab]`` at ``last[b]`` of each row (default: the final position).

        ``tokens, positions`` ``[batch, seq]``; ``cache`` has ``update(layer_id, k, v) -> (k_all,
        v_all, mask)`` as for ``Decoder.forward``.
        """
        model = self.model
        h = F.embedding(tokens, model.tok_embeddings.weight)
        cos, sin = model.rope(positions, h.dtype)
        half = cos.shape[-1] // 2
        cos = cos.unsqueeze(2)
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)
        for block in self.blocks:
            h = block.forward(h, cos, signed_sin, cache)
        h = h[:, -1] if last is None else h[torch.arange(h.shape[0], device=h.device), last]
        return self.output(_rms_norm(h, _norm(model.norm)))


def _is_plain_decoder(model: nn.Module) -> TypeGuard[Decoder]:
    """A ``Decoder`` LM whose blocks are the stock ones, unwrapped, without hooks or DTensors."""
    if not isinstance(model, Decoder) or type(model).forward is not Decoder.forward or model.args.is_critic:
        return False
    if model.tok_embeddings is None or model.norm is None or model.output is None:
        return False
    for block in model.layers.values():
        if type(block) is not TransformerBlock or type(block.attention) is not Attention:
            return False
        if type(block.attention.core) is not CoreAttention:
            return False
        linears = [block.attention.wq, block.attention.wk, block.attention.wv, block.attention.wo]
        if not block.moe_enabled:
            if type(block.feed_forward) is not FeedForward:
                return False
            linears += [block.feed_forward.w1, block.feed_forward.w2, block.feed_forward.w3]
        if any(type(lin) not in (nn.Linear, Linear) for lin in linears):  # e.g. adapters wrapping them
            return False
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return False
    return not any(hasattr(p, "to_local") for p in model.parameters())
