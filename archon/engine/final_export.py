"""The exports a run writes at its end: the HF folder (merged weights under LoRA) and, with LoRA, the PEFT adapters."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from archon.config import Config
from archon.engine.interface import TrainEngine

logger = logging.getLogger("archon.engine")


def export_final(cfg: Config, engine: TrainEngine, tokenizer: Any, rank0: bool) -> None:
    """Collective: ``run_dir/hf`` (with the tokenizer) when ``saver.export_hf``, and ``run_dir/lora_adapter`` (a PEFT
    folder) when the actor trains LoRA adapters and its engine can write one."""
    if cfg.saver.export_hf:
        engine.export_hf(cfg.run_dir / "hf")
        if rank0:
            tokenizer.save_pretrained(cfg.run_dir / "hf")
    if not cfg.actor.lora.enabled:
        return
    adapter_dir: Path = cfg.run_dir / "lora_adapter"
    if engine.export_peft(adapter_dir):
        if rank0:
            logger.info("LoRA adapters written as a PEFT folder to %s", adapter_dir)
    elif rank0:
        logger.warning(
            "actor.backend '%s' does not export PEFT adapter folders; the adapters are merged into %s only",
            cfg.actor.backend,
            cfg.run_dir / "hf",
        )
