"""Shared pieces of the engine tests: tiny configs, deterministic batches, an SFT loss."""

from __future__ import annotations

import torch

from archon.config import ArchonEngineConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig


def engine_config(path: str, backend: str = "archon:d1", **kw) -> TrainEngineConfig:
    archon = dict(enable_compile=False, ac_mode="full")
    archon.update(kw.pop("archon", {}))
    opt = dict(lr=1e-2, warmup_steps=1, lr_schedule="cosine", max_grad_norm=1.0, weight_decay=0.1)
    opt.update(kw.pop("optimizer", {}))
    mb = dict(n_mbs=1)
    mb.update(kw.pop("mb_spec", {}))
    return TrainEngineConfig(backend=backend, path=path, dtype="float32", archon=ArchonEngineConfig(**archon),
                             optimizer=OptimizerConfig(**opt), mb_spec=MicroBatchSpec(**mb), **kw)


def make_batch(step: int, n: int = 6, vocab: int = 128, min_len: int = 5, max_len: int = 17) -> dict[str, torch.Tensor]:
    """A padded batch of ``n`` random sequences; loss on the second half of each (depends only on ``step``)."""
    g = torch.Generator().manual_seed(1000 + step)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    width = max(lens)
    ids = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width, dtype=torch.float32)
    for b, length in enumerate(lens):
        ids[b, :length] = torch.randint(1, vocab, (length,), generator=g)
        attn[b, :length] = 1
        loss_mask[b, length // 2: length] = 1.0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


def sft_loss(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
    """Token-mean negative log-likelihood of this microbatch's loss tokens."""
    mask = mb["loss_mask"]
    n = mask.sum()
    loss = -(outputs["logprobs"] * mask).sum() / n
    return loss, {"entropy": (outputs["entropy"] * mask).sum() / n}


def sft_weight(mb: dict[str, torch.Tensor]) -> float:
    return float(mb["loss_mask"].sum())
