"""The Qwen-family decoder: embedding, pre-norm blocks (attention + SwiGLU or MoE), norm, head.

Module names follow torchtitan so parallel and pipeline code can address them:
``tok_embeddings``, ``layers`` (a ``ModuleDict`` keyed "0".."n-1", so pipeline splitting can
delete entries), ``norm``, ``output``.  A pipeline stage may set ``tok_embeddings``, ``norm``
or ``output`` to None; ``forward`` then takes / returns hidden states.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn

from models.common.args import DecoderArgs, MoEArgs
from models.common.attention import Attention
from models.common.feed_forward import FeedForward
from models.common.linear import Linear
from models.common.moe import MoE
from models.common.norm import RMSNorm
from models.common.packing import positions_from_cu_seqlens
from models.common.rope import RotaryEmbedding
from models.common.shared_prefix import SegmentLayout


class TransformerBlock(nn.Module):
    """``h = x + attention(attention_norm(x)); out = h + ffn(ffn_norm(h))``."""

    def __init__(self, layer_id: int, args: DecoderArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(
            layer_id,
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            qkv_bias=args.qkv_bias,
            o_bias=args.o_bias,
            qk_norm=args.qk_norm,
            norm_eps=args.norm_eps,
        )
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            moe_args = cast(MoEArgs, args)  # is_moe_layer is only true for args with expert fields
            self.moe = MoE(
                args.dim, moe_args.moe_hidden_dim, moe_args.num_experts, moe_args.top_k, moe_args.norm_topk_prob
            )
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: torch.Tensor | None = None,
        cache: Any = None,
        max_seqlen: int | None = None,
        token_mask: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
        segments: SegmentLayout | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos_sin, cu_seqlens, cache, max_seqlen, segments)
        if not self.moe_enabled:
            return h + self.feed_forward(self.ffn_norm(h))
        replay = routed_experts[:, :, self.layer_id] if routed_experts is not None else None
        return h + self.moe(self.ffn_norm(h), token_mask, replay)

    def init_weights(self, init_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(init_std)


class Decoder(nn.Module):
    """A Qwen-family causal LM (or critic, when ``args.is_critic``)."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # A critic's value head keeps the name ``output`` so parallel plans stay uniform.
        self.output = Linear(args.dim, 1 if args.is_critic else args.vocab_size, bias=False)
        self.tie_weights()

    def _blocks(self) -> list[TransformerBlock]:
        # ``layers`` holds TransformerBlocks (or wrappers that forward their attributes).
        return cast("list[TransformerBlock]", list(self.layers.values()))

    def tie_weights(self) -> None:
        """Make ``output.weight`` the embedding matrix when the model ties them."""
        if not self.args.tie_word_embeddings or self.args.is_critic:
            return
        if self.output is not None and self.tok_embeddings is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    @property
    def embeddings_tied(self) -> bool:
        """True when the LM head and the embedding share one parameter (both present, tied)."""
        return (
            self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is self.tok_embeddings.weight
        )

    def _apply(self, fn, recurse: bool = True):
        # ``to_empty`` (meta -> device) creates new Parameter objects per module and so would
        # untie the LM head from the embedding; re-tie after every conversion.
        module = super()._apply(fn, recurse)
        self.tie_weights()
        return module

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: Any = None,
        token_mask: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
        segments: SegmentLayout | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` (critic: values ``[batch, seq]``).

        Args:
            tokens: ``[batch, seq]`` int64 token ids, or hidden states ``[batch, seq, dim]``
                on a pipeline stage without ``tok_embeddings``.
            positions: ``[batch, seq]`` int64 RoPE positions.  Default: restart at 0 at every
                packed sequence when ``cu_seqlens`` is given, else ``arange(seq)``.  Needed with
                ``cache``, and under context parallel (where this module sees a sequence shard).
            cu_seqlens: int32 ``[n_seqs + 1]`` cumulative lengths of the sequences packed in
                the single row (batch must be 1); attention never crosses a boundary.
            cache: a KV cache with ``update(layer_id, k, v) -> (k_all, v_all, mask)``.
            token_mask: ``[batch, seq]``, true for real tokens: MoE routing statistics and the
                load-balancing loss leave padding out (its outputs are computed as usual).
            routed_experts: ``[batch, seq, n_layers, top_k]`` expert choices to replay in the MoE
                blocks (indexed by layer id, as SGLang returns them; dense layers' entries are
                unused); a row of -1 lets that token route freely.
            keep: int64 indices along ``seq`` of the positions to compute outputs for (the
                others skip the final norm and head); the output's ``seq`` is then ``len(keep)``.
            segments: the single row packed with shared prefixes (``shared_prefix.segment_layout``),
                instead of ``cu_seqlens``; ``positions`` are then required.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        bs, seqlen = h.shape[:2]
        if cu_seqlens is not None and bs != 1:
            raise ValueError(f"cu_seqlens describes one packed row, but the batch has {bs} rows; pack into one row.")
        if positions is None:
            if segments is not None:
                raise ValueError("positions are required with segments (a remainder continues its prefix's).")
            if cache is not None:
                raise ValueError("positions are required with a KV cache (the cache holds earlier tokens).")
            if cu_seqlens is not None:
                positions = positions_from_cu_seqlens(cu_seqlens, seqlen, h.device)
            else:
                positions = torch.arange(seqlen, device=h.device).unsqueeze(0).expand(bs, -1)
        elif positions.dim() == 1:
            positions = positions.unsqueeze(0)
        rope_cos_sin = self.rope(positions, h.dtype)

        max_seqlen = None
        if cu_seqlens is not None and h.is_cuda and cache is None:
            # One host sync per forward for the varlen kernel, not one per layer; the longest
            # sequence may be trailing padding past cu_seqlens[-1].  (Under context parallel
            # seqlen is this rank's chunk and cu_seqlens covers the whole row: no tail counts.)
            longest = torch.maximum((cu_seqlens[1:] - cu_seqlens[:-1]).max(), seqlen - cu_seqlens[-1])
            max_seqlen = int(longest)

        for layer in self.layers.values():
            h = layer(h, rope_cos_sin, cu_seqlens, cache, max_seqlen, token_mask, routed_experts, segments)
        if keep is not None:
            h = h.index_select(1, keep)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        out = self.output(h)
        return out.squeeze(-1) if self.args.is_critic else out

    # ---- initialisation (meta-device models: to_empty, then init_weights) --------------
    def _default_buffer_device(self) -> torch.device:
        for p in self.parameters():
            if p.device.type != "meta":
                return p.device
        return torch.device("cpu")

    @torch.no_grad()
    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        """Re-create non-persistent buffers (RoPE frequencies, router statistics) and zero routing biases."""
        buffer_device = buffer_device if buffer_device is not None else self._default_buffer_device()
        self.rope.init_buffers(buffer_device)
        for layer in self._blocks():
            if layer.moe_enabled:
                layer.moe.init_buffers(buffer_device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise buffers and parameters without a checkpoint (normal(0, initializer_range))."""
        self.init_buffers(buffer_device)
        std = self.args.initializer_range
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self._blocks():
            layer.init_weights(std)
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None and not (self.args.tie_word_embeddings and not self.args.is_critic):
            nn.init.normal_(self.output.weight, mean=0.0, std=std)
