"""How ``ArchonEngine`` runs an Archon model on packed microbatches (its ``MicrobatchRunner``).

A microbatch is one packed row of sequences (``cu_seqlens`` keeps attention inside each).
Under context parallel the model sees this rank's chunk of the row (``cu_seqlens`` stays
global) and the per-token outputs are gathered back to full rows.  MoE models also get the
real-token mask (padding stays out of router statistics) and, under routing replay, the
packed expert choices of the rollout servers.  Under pipeline parallel every microbatch of a
step is padded to one shape (stages exchange fixed-size buffers) and becomes a stage input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from archon.config import TrainEngineConfig
from archon.engine.layout import EngineLayout
from archon.engine.microbatch import (
    ROUTED_EXPERTS,
    Batch,
    PackedMicrobatch,
    pack,
    pack_token_values,
    seqlens_of,
    to_device,
)
from archon.engine.microbatch_loop import pads_to_maximum
from archon.engine.prefix_sharing import share_prefixes
from archon.engine.token_outputs import loss_positions, token_outputs
from models.common.packing import pad_cu_seqlens
from parallel.context_parallel import shard_sequence
from pipeline import Microbatch


class ArchonModelRunner:
    """Packs microbatches for an Archon model and runs it (or this rank's pipeline stages' inputs) on them."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: EngineLayout,
        config: TrainEngineConfig,
        *,
        moe: Any,
        routing_replay: bool,
        is_critic: bool,
        temperature: float,
    ) -> None:
        self.model = model
        self.layout = layout
        self.config = config
        self.moe = moe
        """The MoE balancer (``archon/engine/moe_balance.py``); None for a dense model."""
        self.routing_replay = routing_replay
        self.is_critic = is_critic
        self.temperature = temperature

    def pack(self, batch: Batch, indices: list[int], pad_to: int = 0) -> PackedMicrobatch:
        """Pack ``indices`` into one row: to ``max_tokens_per_mb`` under pad_to_maximum, else to ``pad_to``."""
        if pads_to_maximum(self.config):
            pad_to = self.config.mb_spec.max_tokens_per_mb
        multiple_of = self.layout.parallel_dims.seq_len_divisor
        packed = pack(batch, indices, multiple_of=multiple_of, pad_to=pad_to)
        if self.routing_replay and ROUTED_EXPERTS in batch:
            # Positions without a server choice (padding, a completion's last token) route freely.
            packed.routed_experts = pack_token_values(batch[ROUTED_EXPERTS], packed, fill=-1)
        if self.config.archon.prefix_sharing:
            packed.shared = share_prefixes(batch, packed, multiple_of)
        return packed

    def loss_positions(self, batch: Batch, mb: PackedMicrobatch) -> torch.Tensor | None:
        """Packed positions the loss reads (``loss_positions``); None (every position) for a critic
        or when the layout shards the sequence or the vocabulary (TP, CP, PP)."""
        pd = self.layout.parallel_dims
        if self.is_critic or pd.tp_enabled or pd.cp_enabled or pd.pp_enabled:
            return None
        return loss_positions(batch, mb)

    def model_inputs(self, mb: PackedMicrobatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """Tokens and the per-token keyword inputs the model (or every pipeline stage) sees: this CP rank's chunk;
        the row with shared prompts held once when ``mb`` has one (no CP then)."""
        device = self.layout.device
        if mb.shared is not None:
            return mb.shared.tokens, {"positions": mb.shared.positions, "segments": mb.shared.segments}
        kwargs: dict[str, Any] = {"positions": mb.positions, "cu_seqlens": mb.cu_seqlens}
        if self.moe is not None:
            kwargs["token_mask"] = (torch.arange(mb.total_len, device=device) < mb.n_real_tokens)[None]
            if mb.routed_experts is not None:
                kwargs["routed_experts"] = mb.routed_experts.to(device, torch.int64)
        cp_mesh = self.layout.parallel_dims.get_optional_mesh("cp")
        if cp_mesh is None:
            return mb.tokens, kwargs
        # cu_seqlens describes the full row (see UlyssesAttention).
        sharded = {k: v if k == "cu_seqlens" else shard_sequence(v, cp_mesh) for k, v in kwargs.items()}
        return shard_sequence(mb.tokens, cp_mesh), sharded

    def run(self, mb: PackedMicrobatch, keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Packed forward; token-aligned per-token outputs, unpacked to ``[b, s]`` rows.

        With ``keep`` (packed positions) only those positions get logits; the others' outputs are 0.
        """
        tokens, kwargs = self.model_inputs(mb)
        expand = mb.shared.expand if mb.shared is not None else None
        if keep is not None:
            # Outputs at the plain packing's positions ``keep`` only (read from the shared row where there is one).
            kwargs["keep"] = keep if expand is None else expand[keep]
        with self.layout.autocast(self.config.dtype):
            out = self.model(tokens, **kwargs)
        if expand is not None and keep is None:
            # Every position of the plain packing, read from the shared row (after the LM head: under TP the
            # sequence-parallel norm before it takes the row as the model laid it out).
            if isinstance(out, DTensor):  # TP's vocabulary-sharded logits: the index alike on every rank
                expand = DTensor.from_local(expand, out.device_mesh, [Replicate()] * out.device_mesh.ndim)
            out = out.index_select(1, expand)
        return self.token_outputs(out, mb, keep)

    def route(self, mb: PackedMicrobatch) -> None:
        """A forward whose only use is what the MoE routers count (no outputs)."""
        tokens, kwargs = self.model_inputs(mb)
        with self.layout.autocast(self.config.dtype):
            self.model(tokens, **kwargs)

    def token_outputs(
        self, out: torch.Tensor, mb: PackedMicrobatch, keep: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The model's output for packed ``mb`` as token-aligned per-token rows (``token_outputs``)."""
        cp_mesh = self.layout.parallel_dims.get_optional_mesh("cp")
        return token_outputs(out, mb, keep, is_critic=self.is_critic, temperature=self.temperature, cp_mesh=cp_mesh)

    def pipeline_microbatches(
        self, batch: Batch, mbs: list[list[int]]
    ) -> tuple[list[PackedMicrobatch], list[Microbatch]]:
        """Packed microbatches of one shape (pipeline stages exchange fixed-size buffers) and their stage inputs.

        Every row is padded to the step's longest (a multiple of tp*cp); ``cu_seqlens`` are
        padded to one length with empty trailing sequences, so they split like the rest.  Under
        context parallel the stage inputs are this rank's chunk (``token_outputs`` gathers).
        """
        device = self.layout.device
        lens = seqlens_of(batch)
        longest = max(1, max(sum(lens[i] for i in indices) for indices in mbs))
        packs = [to_device(self.pack(batch, indices, pad_to=longest), device) for indices in mbs]
        n_bounds = max(p.cu_seqlens.numel() for p in packs)
        inputs = []
        for p in packs:
            # Every stage gets the positions (and MoE inputs) of this rank's chunk; the boundaries stay global.
            tokens, kwargs = self.model_inputs(p)
            inputs.append((tokens, {**kwargs, "cu_seqlens": pad_cu_seqlens(p.cu_seqlens, n_bounds)}))
        return packs, inputs
