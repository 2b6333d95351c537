"""Completions from the rollout servers to the padded, token-aligned batch the engines take.

Row ``b`` is ``prompt + completion``.  Per-token tensors follow the engine's convention:
position ``i`` is about token ``i`` (its logprob given tokens ``< i``), so the completion's
behaviour logprobs (as the server reports them) sit at the completion positions and
``loss_mask`` is 1 exactly there.  A completion that ended with EOS or a stop token keeps
that token (it is what teaches the policy to stop).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


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
    routed_experts: Any = None
    """MoE routing replay: int array ``[prompt + output - 1, n_layers, top_k]`` of the experts the
    server ran each token through (the last output token is never run), or None."""
    output_versions: list[int] | None = None
    """Policy version that generated each token (asynchronous RL; None when not tracked)."""

    @property
    def truncated(self) -> bool:
        """True when the completion was cut off without a stop token (length limit or abort)."""
        return self.finish_reason != "stop"


def build_rollout_batch(
    completions: Sequence[Completion], rewards: Sequence[float], pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """``input_ids, attention_mask, loss_mask, logprobs`` ``[B, S]`` and ``rewards, seq_no_eos_mask`` ``[B]``."""
    if len(completions) != len(rewards):
        raise ValueError(f"{len(completions)} completions but {len(rewards)} rewards; one reward per completion")
    if not completions:
        raise ValueError("build_rollout_batch() got no completions; a step needs at least one")
    for i, c in enumerate(completions):
        if len(c.output_logprobs) != len(c.output_ids):
            raise ValueError(
                f"completion {i} has {len(c.output_ids)} tokens but {len(c.output_logprobs)} logprobs; "
                "request generations with return_logprob = true"
            )
        if not c.prompt_ids:
            raise ValueError(f"completion {i} has an empty prompt; every RL prompt needs at least one token")
    # Built from flat lists with masks: an RL batch is hundreds of short rows, and a tensor op
    # per row would cost more than the rest of the batch's preparation.
    prompt_lens = torch.tensor([len(c.prompt_ids) for c in completions])
    total_lens = prompt_lens + torch.tensor([len(c.output_ids) for c in completions])
    col = torch.arange(int(total_lens.max()))
    attention = col < total_lens[:, None]
    response = attention & (col >= prompt_lens[:, None])
    input_ids = torch.full(attention.shape, pad_token_id, dtype=torch.long)
    input_ids[attention] = torch.tensor(
        [t for c in completions for t in (*c.prompt_ids, *c.output_ids)], dtype=torch.long
    )
    logprobs = torch.zeros(attention.shape, dtype=torch.float32)
    logprobs[response] = torch.tensor([float(x) for c in completions for x in c.output_logprobs], dtype=torch.float32)
    batch = {
        "input_ids": input_ids,
        "loss_mask": response.float(),
        "logprobs": logprobs,
        "rewards": torch.tensor([float(r) for r in rewards], dtype=torch.float32),
        "seq_no_eos_mask": torch.tensor([bool(c.truncated) for c in completions], dtype=torch.bool),
        "attention_mask": attention.long(),
    }
    if any(c.routed_experts is not None for c in completions):
        batch["routed_experts"] = _routed_experts_rows(completions, batch["input_ids"].shape[1])
    return batch


def _routed_experts_rows(completions: Sequence[Completion], width: int) -> torch.Tensor:
    """``[B, S, n_layers, top_k]`` int16, token-aligned like ``input_ids``; -1 where no routing is known."""
    shapes = {tuple(c.routed_experts.shape[1:]) for c in completions if c.routed_experts is not None}
    if len(shapes) != 1:
        raise ValueError(
            f"completions carry routed experts of different shapes {sorted(shapes)} (or only some "
            "carry them); every server must serve the same model with routed experts on"
        )
    out = torch.full((len(completions), width, *shapes.pop()), -1, dtype=torch.int16)
    for b, c in enumerate(completions):
        if c.routed_experts is None:
            raise ValueError(f"completion {b} has no routed experts while others do; request them for every one")
        routed = torch.as_tensor(c.routed_experts)
        n = len(c.prompt_ids) + len(c.output_ids)
        # A completion without output tokens has nothing to train on; anything else covers n - 1 tokens.
        if routed.shape[0] != n - 1 and (c.output_ids or routed.shape[0] > n):
            raise ValueError(
                f"completion {b} has routed experts for {routed.shape[0]} tokens, expected {n - 1} "
                "(prompt + output - 1); was routed_experts_start_len left at 0?"
            )
        out[b, : routed.shape[0]] = routed.to(torch.int16)
    return out


def routed_experts_array(flat: Any, n_layers: int, top_k: int) -> Any:
    """A server's flat routed experts (``GenerateResult.routed_experts``) as ``[tokens, n_layers, top_k]``; None stays
    None."""
    if flat is None:
        return None
    if flat.size % (n_layers * top_k):
        raise ValueError(
            f"a server returned {flat.size} routed expert ids, not a multiple of n_layers * top_k = "
            f"{n_layers} * {top_k}; does it serve the actor's model?"
        )
    return flat.reshape(-1, n_layers, top_k)


def split_minibatches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Cut the batch's rows into ``n`` contiguous minibatches of (nearly) equal size.

    Minibatches without a loss token are left out (there is nothing to step on).

    Contiguous keeps the samples of a prompt together; the split depends only on the batch
    size, never on the allocation, so every layout makes the same optimizer steps.
    """
    rows = batch["input_ids"].shape[0]
    if n < 1 or n > rows:
        raise ValueError(
            f"ppo_n_minibatches = {n} must be between 1 and the number of samples ({rows}); "
            "lower actor.ppo_n_minibatches or raise the batch size"
        )
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


def ppo_minibatches(
    batch: dict[str, torch.Tensor], n: int, *, epochs: int = 1, shuffle: bool = False, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
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
            order = {
                key: value[perm] if value.dim() >= 1 and value.shape[0] == rows else value
                for key, value in batch.items()
            }
        yield from split_minibatches(order, n)
