"""Per-token outputs of a packed forward: which positions the loss reads, and token-aligned rows.

``loss_positions`` picks the packed positions whose logits a loss can read (those predicting a
``loss_mask`` token), so that the LM head and the logprobs skip the rest (an RL batch's
prompts).  ``token_outputs`` turns the model's output for a packed microbatch (logits, or a
critic's values) into token-aligned ``[b, s]`` rows: ``logprobs[b, i]`` is about token ``i``
given the tokens before it, 0 at each sequence's first token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from archon.engine.microbatch import Batch, PackedMicrobatch, concat_rows, unpack
from parallel.context_parallel import gather_sequence, shard_sequence
from parallel.loss_parallel import vocab_parallel_logprobs_entropy


def output_keys(is_critic: bool) -> list[str]:
    """Per-token outputs of a forward: a critic's values, or an LM's logprobs and entropy."""
    return ["values"] if is_critic else ["logprobs", "entropy"]


def loss_positions(batch: Batch, mb: PackedMicrobatch) -> torch.Tensor | None:
    """Packed positions of ``mb`` that predict a ``loss_mask`` token; None (every position) without
    ``loss_mask`` or when nearly every position is needed anyway."""
    if "loss_mask" not in batch:
        return None
    loss_mask = batch["loss_mask"]
    masked = torch.zeros(mb.total_len, dtype=torch.bool, device=loss_mask.device)
    if mb.indices:
        masked[: mb.n_real_tokens] = concat_rows(loss_mask, mb.indices, mb.seqlens) > 0
    masked[mb.seq_starts] = False  # a sequence's first token has no predicting position (its logprob is 0)
    keep = masked.nonzero().squeeze(1) - 1
    return keep if keep.numel() < 0.9 * mb.total_len else None


def token_outputs(
    out: torch.Tensor,
    mb: PackedMicrobatch,
    keep: torch.Tensor | None,
    *,
    is_critic: bool,
    temperature: float,
    cp_mesh: DeviceMesh | None,
) -> dict[str, torch.Tensor]:
    """The model's output for packed ``mb`` (logits or values) as token-aligned per-token rows.

    Next-token targets come from the full row; under context parallel the per-token outputs
    are gathered back to full rows, the same on every CP rank (see ``gather_sequence``).
    ``keep``: the packed positions ``out`` holds (all when None); the others get 0.
    """
    if is_critic:
        values = out.full_tensor() if isinstance(out, DTensor) else out
        rows = [values.reshape(-1).float()]
    else:
        targets = torch.roll(mb.tokens[0], -1)
        if cp_mesh is not None:
            targets = shard_sequence(targets, cp_mesh, dim=0)
        if keep is not None:
            targets = targets[keep]
        # Kept apart (not stacked): an output the loss ignores then gets no gradient at all,
        # and its backward is skipped (the entropy's is a tokens x vocab pass).
        # The whole [1, T, V] logits (a view inside), not out[0]: a select's backward would
        # write its gradient into a zero-filled copy of the logits.
        rows = [r[0] for r in vocab_parallel_logprobs_entropy(out, targets.unsqueeze(0), temperature)]
    # ``_anchor`` keeps a graph through the model even when the microbatch has no sample.
    anchor = rows[0].sum() * 0.0
    if keep is not None:
        rows = [row.new_zeros(mb.total_len).index_copy(0, keep, row) for row in rows]
    result = {}
    for key, row in zip(output_keys(is_critic), rows):
        if cp_mesh is not None:
            row = gather_sequence(row, cp_mesh, dim=0)
        # Output i is about token i: shift the next-token values right; sequence starts get 0.
        aligned = torch.roll(row, 1, dims=0).index_fill(0, mb.seq_starts, 0.0)
        result[key] = unpack(aligned, mb)
    result["_anchor"] = anchor
    return result


class CollectedRows:
    """Per-token rows of a forward, microbatch by microbatch, put back in global batch order on every rank.

    The rows stay on the device until ``assemble`` copies them all to the host at once: one wait
    for the GPU per forward instead of one per microbatch and output.
    """

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.indices: list[int] = []
        self.blocks: list[dict[str, torch.Tensor]] = []  # per microbatch: key -> [rows, width] on the device

    def add(self, outputs: dict[str, torch.Tensor], indices: list[int]) -> None:
        """A microbatch's ``token_outputs`` for samples ``indices`` (none: a padding-only microbatch)."""
        outputs.pop("_anchor")
        if not indices:
            return
        self.indices.extend(indices)
        self.blocks.append({key: outputs[key].detach().float() for key in self.keys})

    def _host_rows(self) -> dict[str, list[torch.Tensor]]:
        flat = [block[key] for block in self.blocks for key in self.keys]
        if not flat:
            return {key: [] for key in self.keys}
        host = iter(torch.cat([t.reshape(-1) for t in flat]).cpu().split([t.numel() for t in flat]))
        rows: dict[str, list[torch.Tensor]] = {key: [] for key in self.keys}
        for block in self.blocks:
            for key in self.keys:
                # Copies, not views: a pickled view (all_gather_object) would carry the whole buffer.
                rows[key].extend(row.clone() for row in next(host).view(block[key].shape))
        return rows

    def assemble(self, shape: tuple[int, ...], dp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
        """``[B, S]`` float32 rows per key (0 past each sequence), from every rank of ``dp_group`` (None: this one)."""
        mine = (self.indices, self._host_rows())
        gathered: list[Any] = [mine]
        if dp_group is not None:
            gathered = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(gathered, mine, group=dp_group)
        result = {k: torch.zeros(shape, dtype=torch.float32) for k in self.keys}
        for indices, values in gathered:
            for key in self.keys:
                for row, idx in enumerate(indices):
                    result[key][idx, : values[key][row].shape[0]] = values[key][row]
        return result
