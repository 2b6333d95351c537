"""How ``FSDPEngine`` runs a transformers model on microbatches (its ``MicrobatchRunner``).

A microbatch is one packed row with ``position_ids`` restarting at every sequence, which
transformers turns into a block-diagonal causal mask; under context parallel the Ulysses
attention (``transformers_model.ulysses_attention``) gets this rank's chunk and the row's
boundaries.  For a model whose attention ignores packing (``FSDPEngine`` probes it), a
microbatch is right-padded rows with an attention mask instead (``PaddedMicrobatch``).  Both
give the same token-aligned per-token outputs as ``ArchonEngine``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from archon.config import TrainEngineConfig
from archon.engine.layout import EngineLayout
from archon.engine.microbatch import Batch, PackedMicrobatch, pack, rows_of
from archon.engine.microbatch_loop import pads_to_maximum
from archon.engine.token_outputs import output_keys, token_outputs
from parallel.context_parallel import shard_sequence
from parallel.loss_parallel import vocab_parallel_logprobs_entropy


@dataclass
class PaddedMicrobatch:
    """Right-padded rows (for models whose attention cannot take packed rows)."""

    indices: list[int]
    """Sample indices (into the global batch), one row each."""
    seqlens: list[int]
    """Length of each row's sequence."""
    tokens: torch.Tensor
    """[rows, width] token ids (one padding row when ``indices`` is empty)."""
    attention_mask: torch.Tensor
    """[rows, width] 1 on real tokens."""
    n_real_tokens: int
    """Tokens that belong to real sequences."""


class TransformersRunner:
    """Packs (or pads) microbatches for a transformers model and runs it on them."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: EngineLayout,
        config: TrainEngineConfig,
        *,
        packed: bool,
        is_critic: bool,
        temperature: float,
    ) -> None:
        self.model = model
        self.layout = layout
        self.config = config
        self.packed = packed
        """Packed rows (position_ids); False: right-padded rows with an attention mask."""
        self.is_critic = is_critic
        self.temperature = temperature

    def pack(self, batch: Batch, indices: list[int]) -> PackedMicrobatch | PaddedMicrobatch:
        if not self.packed:
            return pad_rows(batch, indices)
        pad_to = self.config.mb_spec.max_tokens_per_mb if pads_to_maximum(self.config) else 0
        # Sequence parallel is not used, so only Ulysses needs lengths divisible by c.
        return pack(batch, indices, multiple_of=self.layout.parallel_dims.cp, pad_to=pad_to)

    def loss_positions(self, batch: Batch, mb: PackedMicrobatch | PaddedMicrobatch) -> None:
        """Every position: transformers models compute their head over the whole sequence."""
        return None

    def run(self, mb: PackedMicrobatch | PaddedMicrobatch, keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        assert keep is None, "the fsdp engine computes every position"
        if isinstance(mb, PaddedMicrobatch):
            return self._run_padded(mb)
        tokens, positions = mb.tokens, mb.positions
        kwargs = {}
        cp_mesh = self.layout.parallel_dims.get_optional_mesh("cp")
        if cp_mesh is not None:
            # This rank's chunk of the row; the attention function gets the group and the global boundaries.
            tokens, positions = shard_sequence(tokens, cp_mesh), shard_sequence(positions, cp_mesh)
            kwargs = dict(
                archon_cp_group=cp_mesh.get_group(), archon_cp_size=cp_mesh.size(), archon_cu_seqlens=mb.cu_seqlens
            )
        with self.layout.autocast(self.config.dtype):
            out = self.model(input_ids=tokens, position_ids=positions, use_cache=False, **kwargs)
        return token_outputs(
            self._head_output(out), mb, None, is_critic=self.is_critic, temperature=self.temperature, cp_mesh=cp_mesh
        )

    def _head_output(self, out) -> torch.Tensor:
        """Logits ``[b, s, V]`` (maybe a vocab-sharded DTensor), or a critic's values ``[b, s]``."""
        logits = out.logits
        if self.is_critic:
            values = logits.full_tensor() if isinstance(logits, DTensor) else logits
            return values.squeeze(-1)
        return logits

    def _run_padded(self, mb: PaddedMicrobatch) -> dict[str, torch.Tensor]:
        """Right-padded rows through the model; the same token-aligned outputs as the packed path."""
        with self.layout.autocast(self.config.dtype):
            out = self.model(input_ids=mb.tokens, attention_mask=mb.attention_mask, use_cache=False)
        head = self._head_output(out)
        if self.is_critic:
            per_token = head.float().unsqueeze(0)
        else:
            targets = torch.roll(mb.tokens, -1, dims=1)
            per_token = torch.stack(vocab_parallel_logprobs_entropy(head, targets, self.temperature))
        anchor = per_token.sum() * 0.0
        # Output i is about token i: shift right; each row's first token (and its padding) get 0.
        aligned = torch.roll(per_token, 1, dims=2)
        aligned[:, :, 0] = 0.0
        aligned = aligned * mb.attention_mask.to(aligned.dtype)
        width = max(mb.seqlens, default=0)
        result = {key: rows[: len(mb.indices), :width] for key, rows in zip(output_keys(self.is_critic), aligned)}
        result["_anchor"] = anchor
        return result


def pad_rows(batch: Batch, indices: list[int]) -> PaddedMicrobatch:
    """Rows ``indices`` right-padded to their longest; an empty microbatch is one padding token."""
    if not indices:
        tokens = batch["input_ids"].new_zeros(1, 1)
        return PaddedMicrobatch([], [], tokens, torch.ones_like(tokens), 0)
    rows = rows_of(batch, indices)
    mask = rows["attention_mask"]
    seqlens = [int(n) for n in mask.sum(dim=1)]
    return PaddedMicrobatch(list(indices), seqlens, rows["input_ids"], mask, sum(seqlens))
