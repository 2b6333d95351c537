"""Shared pieces of the engine tests: tiny configs, deterministic batches, an SFT loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from archon.config import ArchonEngineConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from archon.gpu_check.tiny import make_batch  # noqa: F401 - the engine tests' batches, shared with gpu_check


def engine_config(path: str, backend: str = "archon:d1", **kw) -> TrainEngineConfig:
    archon: dict[str, Any] = dict(enable_compile=False, ac_mode="full")
    archon.update(kw.pop("archon", {}))
    opt: dict[str, Any] = dict(lr=1e-2, warmup_steps=1, lr_schedule="cosine", max_grad_norm=1.0, weight_decay=0.1)
    opt.update(kw.pop("optimizer", {}))
    mb: dict[str, Any] = dict(n_mbs=1)
    mb.update(kw.pop("mb_spec", {}))
    return TrainEngineConfig(
        backend=backend,
        path=path,
        dtype="float32",
        archon=ArchonEngineConfig(**archon),
        optimizer=OptimizerConfig(**opt),
        mb_spec=MicroBatchSpec(**mb),
        **kw,
    )


def sft_loss(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
    """Token-mean negative log-likelihood of this microbatch's loss tokens."""
    mask = mb["loss_mask"]
    n = mask.sum()
    loss = -(outputs["logprobs"] * mask).sum() / n
    return loss, {"entropy": (outputs["entropy"] * mask).sum() / n}


def sft_weight(mb: dict[str, torch.Tensor]) -> float:
    return float(mb["loss_mask"].sum())


def resume_losses(path: str, ckpt: str, phase: str, backend: str, steps: int = 4) -> list[float] | None:
    """Per-step SFT losses of one phase of a resume check, on ``backend`` (rank 0 returns them).

    ``full``: all ``steps`` uninterrupted; ``first``: the first two, then a checkpoint in
    ``ckpt``; ``second``: load ``ckpt`` and train the rest.  ``first`` + ``second`` must equal
    ``full`` whatever the two phases' allocations are.
    """
    import torch.distributed as dist

    from archon.engine import build_engine as make_engine

    engine = make_engine(engine_config(path, backend), total_steps=steps).initialize()
    if phase == "full":
        todo = range(steps)
    elif phase == "first":
        todo = range(2)
    else:
        extra = engine.load(ckpt)
        assert extra == {"data_position": 2} and engine.step == 2
        todo = range(2, steps)
    losses = [engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in todo]
    if phase == "first":
        engine.save(ckpt, extra_state={"data_position": 2})
    return losses if dist.get_rank() == 0 else None


def export_after_one_step(path: str, backend: str, out: str, engine_kw: dict | None = None) -> None:
    """Train one SFT step on ``backend`` (engine config options ``engine_kw``) and ``export_hf`` to ``out``."""
    from archon.engine import build_engine as make_engine

    engine = make_engine(engine_config(path, backend, **(engine_kw or {})), total_steps=1).initialize()
    engine.train_batch(make_batch(0), sft_loss, sft_weight)
    engine.export_hf(out)


def critic_losses_and_values(path: str, backend: str):
    """Two value-regression steps of a critic on ``backend``, then its values.

    Rank 0 returns ``(losses, grad_norms, values)``; the gradient norms catch a gradient scaled
    by a constant, which AdamW's updates (and so the losses) would hide.
    """
    import torch.distributed as dist

    from archon.engine import build_engine as make_engine

    engine = make_engine(engine_config(path, backend), is_critic=True, total_steps=2).initialize()
    batch = make_batch(0)
    batch["returns"] = torch.linspace(-1, 1, batch["input_ids"].numel()).view_as(batch["input_ids"])

    def value_loss(outputs, mb):
        mask = mb["loss_mask"]
        return (((outputs["values"] - mb["returns"]) ** 2) * mask).sum() / mask.sum(), {}

    stats = [engine.train_batch(batch, value_loss, sft_weight) for _ in range(2)]
    values = engine.forward(batch)["values"]
    result = ([s["loss"] for s in stats], [s["grad_norm"] for s in stats], values)
    return result if dist.get_rank() == 0 else None


def forward_outputs(path: str, backend: str) -> dict[str, torch.Tensor]:
    """``engine.forward`` of a frozen engine on ``backend`` (2 microbatches) for ``make_batch(7, n=5)``."""
    from archon.engine import build_engine as make_engine

    engine = make_engine(engine_config(path, backend, mb_spec={"n_mbs": 2}), trainable=False).initialize()
    return engine.forward(make_batch(7, n=5))


def build_engine(path: str, backend: str, engine_kw: dict | None = None) -> str:
    """Only ``initialize()`` an engine (for tests of what a layout refuses)."""
    from archon.engine import build_engine as make_engine

    make_engine(engine_config(path, backend, **(engine_kw or {}))).initialize()
    return "built"


def capture_log(name: str) -> list[str]:
    """Messages the logger ``name`` emits from now on (at INFO and above), appended to the returned list."""
    import logging

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger(name)
    logger.addHandler(Grab())
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    return records


def full_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` whole: a DTensor gathered (a collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def record_grads(engine: Any, params: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Make ``engine``'s optimizer record, before each step, the full gradient of every parameter in ``params``
    that has one; returns the list it appends a ``{name: gradient}`` to per step."""
    grads: list[dict[str, torch.Tensor]] = []
    step = engine.optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        grads.append({n: full_copy(p.grad) for n, p in params.items() if p.grad is not None})
        return step(*args, **kwargs)

    engine.optimizer.step = recording_step
    return grads
