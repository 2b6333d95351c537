"""Supervised fine-tuning on ``{"prompt", "completion"}`` jsonl with the Archon engine.

The loss is the mean negative log-likelihood over the completion tokens (and EOS) of the
whole global batch, whatever the allocation.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from archon.checkpoint.manager import CheckpointManager
from archon.checkpoint.schedule import SaveSchedule
from archon.cli import init_run
from archon.config import Config
from archon.config.preflight import preflight
from archon.data.collate import collate
from archon.data.encoding import load_tokenizer
from archon.data.from_config import build_sft_dataset, describe_chat_template
from archon.data.sampler import EpochSampler
from archon.engine import build_engine
from archon.engine.final_export import export_final
from archon.metrics import MetricsLogger, peak_memory_gb
from archon.runtime.gc_freeze import freeze_startup_objects, thaw_startup_objects

logger = logging.getLogger("archon.sft")


def sft_loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Token-mean NLL of this microbatch's loss tokens (the engine reweights by token count)."""
    mask = mb["loss_mask"].to(outputs["logprobs"].dtype)
    n = mask.sum().clamp(min=1.0)
    loss = -(outputs["logprobs"] * mask).sum() / n
    return loss, {"entropy": (outputs["entropy"].detach() * mask).sum() / n}


def loss_token_count(mb: dict[str, torch.Tensor]) -> float:
    return float(mb["loss_mask"].sum())


def run_sft(cfg: Config) -> list[dict[str, Any]]:
    """Train ``cfg.actor`` on ``cfg.train_dataset`` for ``cfg.total_train_steps``; returns the metrics."""

    report = preflight(cfg, "sft")  # what `python -m archon.config --job sft` checks; resolves hub ids in cfg
    init_run(cfg, "sft")
    ckpt = CheckpointManager(cfg.run_dir, cfg.saver.keep_last)
    ckpt.check_writable()
    engine = build_engine(
        cfg.actor, name="actor", seed=cfg.seed, device=cfg.device, total_steps=cfg.total_train_steps
    ).initialize()
    ckpt.check_space({"actor": engine})
    rank0 = dist.get_rank() == 0
    if rank0:
        logger.info("start checks: %s", "; ".join(report))
    tokenizer = load_tokenizer(cfg.actor.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dataset = build_sft_dataset(cfg.train_dataset, tokenizer)
    if rank0:
        logger.info(describe_chat_template(cfg.train_dataset, tokenizer))
    sampler = EpochSampler(
        len(dataset),
        cfg.train_dataset.batch_size,
        seed=cfg.seed,
        shuffle=cfg.train_dataset.shuffle,
        drop_last=cfg.train_dataset.drop_last,
    )
    extra = ckpt.load({"actor": engine})
    if extra is not None:
        sampler.load_state_dict(extra["sampler"])
        if rank0:
            logger.info("resumed from %s at step %d", ckpt.loaded, engine.step)
    metrics_log = MetricsLogger(
        cfg.run_dir,
        cfg.total_train_steps,
        enabled=rank0,
        headline=("loss", "grad_norm", "tokens_per_s"),
        start_step=engine.step,
        run_config=cfg,
    )
    history = []
    freeze_startup_objects()
    schedule = SaveSchedule(cfg.saver, cfg.total_train_steps)
    try:
        while engine.step < cfg.total_train_steps:
            t0 = time.perf_counter()
            batch = collate([dataset[i] for i in sampler.next_batch()], pad_token_id=pad_id)
            stats = engine.train_batch(batch, sft_loss_fn, loss_token_count)
            elapsed = time.perf_counter() - t0
            record = {
                "step": engine.step,
                "loss": stats["loss"],
                "grad_norm": stats["grad_norm"],
                "lr": stats["lr"],
                "tokens": stats["tokens"],
                "tokens_per_s": stats["tokens"] / elapsed,
                "step_time_s": elapsed,
                "peak_mem_gb": peak_memory_gb(engine.device_type),
                "entropy": stats.get("entropy"),
                "update_skipped": stats["update_skipped"],
            }
            # MoE router statistics (load imbalance, idle experts, aux loss or routing bias).
            record.update({k: v for k, v in stats.items() if k.startswith("moe/")})
            history.append(record)
            metrics_log.log(record)
            if schedule.due(engine.step):
                ckpt.save(engine.step, {"actor": engine}, {"sampler": sampler.state_dict()})
    finally:
        metrics_log.close()
        thaw_startup_objects()
    export_final(cfg, engine, tokenizer, rank0)
    return history
