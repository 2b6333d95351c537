"""Completions from the rollout servers to the padded, token-aligned batch the engines take.

Row ``b`` is ``prompt + completion``.  Per-token tensors follow the engine's convention:
position ``i`` is about token ``i`` (its logprob given tokens ``< i``), so the completion's
behaviour logprobs (as the server reports them) sit at the completion positions and
``loss_mask`` is 1 exactly there.  A completion that ended with EOS or a stop token keeps
that token (it is what teaches the policy to stop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from archon.data.collate import collate


@dataclass
class Completion:
    """One sampled completion, as the trainer needs it (independent of the HTTP client)."""

    prompt_ids: list[int]
    """Prompt token ids sent to the server."""
    output_ids: list[int]
    """Generated token ids (including a final EOS/stop token when it stopped on one)."""
    output_logprobs: list[float]
    """Behaviour logprob of each generated token: log_softmax(logits / T) before top-k/top-p."""
    finish_reason: str
    """'stop' (EOS or a stop token), 'length' (token budget or context) or 'abort'."""
    output_versions: list[int] | None = None
    """Policy version that generated each token (asynchronous RL; None when not tracked)."""

    @property
    def truncated(self) -> bool:
        """True when the completion was cut off without a stop token (length limit or abort)."""
        return self.finish_reason != "stop"


def build_rollout_batch(completions: Sequence[Completion], rewards: Sequence[float],
                        pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """``input_ids, attention_mask, loss_mask, logprobs`` ``[B, S]`` and ``rewards, seq_no_eos_mask`` ``[B]``."""
    if len(completions) != len(rewards):
        raise ValueError(f"{len(completions)} completions but {len(rewards)} rewards; one reward per completion")
    samples = []
    for i, c in enumerate(completions):
        if len(c.output_logprobs) != len(c.output_ids):
            raise ValueError(f"completion {i} has {len(c.output_ids)} tokens but {len(c.output_logprobs)} logprobs; "
                             "request generations with return_logprob = true")
        if not c.prompt_ids:
            raise ValueError(f"completion {i} has an empty prompt; every RL prompt needs at least one token")
        p, n = len(c.prompt_ids), len(c.output_ids)
        samples.append({
            "input_ids": list(c.prompt_ids) + list(c.output_ids),
            "loss_mask": [0] * p + [1] * n,
            "logprobs": [0.0] * p + [float(x) for x in c.output_logprobs],
            "rewards": float(rewards[i]),
            "seq_no_eos_mask": bool(c.truncated),
        })
    batch = collate(samples, pad_token_id=pad_token_id)
    # collate infers integer dtypes from values: keep the float/mask fields in their kinds.
    batch["loss_mask"] = batch["loss_mask"].float()
    batch["logprobs"] = batch["logprobs"].float()
    batch["rewards"] = batch["rewards"].float()
    return batch


def split_minibatches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Cut the batch's rows into ``n`` contiguous minibatches of (nearly) equal size.

    Minibatches without a loss token are left out (there is nothing to step on).

    Contiguous keeps the samples of a prompt together; the split depends only on the batch
    size, never on the allocation, so every layout makes the same optimizer steps.
    """
    rows = batch["input_ids"].shape[0]
    if n < 1 or n > rows:
        raise ValueError(f"ppo_n_minibatches = {n} must be between 1 and the number of samples ({rows}); "
                         "lower actor.ppo_n_minibatches or raise the batch size")
    bounds = [round(i * rows / n) for i in range(n + 1)]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if float(batch["loss_mask"][lo:hi].sum()) == 0:
            continue  # nothing to train on (e.g. only aborted, empty completions)
        width = int(batch["attention_mask"][lo:hi].sum(dim=1).max())
        mb = {}
        for key, value in batch.items():
            part = value[lo:hi]
            mb[key] = part[:, :width] if part.dim() >= 2 else part
        out.append(mb)
    return out


def ppo_minibatches(batch: dict[str, torch.Tensor], n: int, *, epochs: int = 1, shuffle: bool = False,
                    seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """``epochs`` passes over the batch, each cut into ``n`` minibatches (``split_minibatches``).

    With ``shuffle`` the rows are permuted before each pass by a generator seeded with
    ``(seed, pass)`` only, so every allocation and a resumed run make the same optimizer steps.
    """
    if epochs < 1:
        raise ValueError(f"ppo_epochs = {epochs} must be at least 1")
    rows = batch["input_ids"].shape[0]
    for epoch in range(epochs):
        order = batch
        if shuffle:
            gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7_919 + 17) % (2**63 - 1))
            perm = torch.randperm(rows, generator=gen)
            order = {key: value[perm] if value.dim() >= 1 and value.shape[0] == rows else value
                     for key, value in batch.items()}
        yield from split_minibatches(order, n)
