"""Rehearse a cluster layout on one machine: a shrunken model, the actor's allocation, real gloo ranks.

``python -m archon.plan rehearse --config x.toml [overrides]`` reads the actor's model config
and allocation and builds the smallest model of the same type that the allocation still
splits: as many layers as pipeline stages (one per stage), ``t`` key/value heads and enough
query heads for ``t x c`` (keeping grouped-query attention), ``e`` experts (top-k at most 2),
widths a multiple of ``t``.  It trains a few SFT steps of random token sequences under the
actor's allocation, one forked CPU process per rank (gloo), then the same model and data under
``archon:d1``, and compares every step's loss and gradient norm (float32, within 1e-4
relative): "the layout trains like one device", or the first difference.

What a CPU run cannot or need not keep is changed, and said: float32 instead of bf16,
torch.compile and deterministic kernels off, the fewest microbatches the pipeline schedule
accepts, a learning rate large enough for the updates to show in the next step's loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from archon.alloc import ModelAllocation
from archon.config import load_config
from archon.engine.engine import ArchonEngine  # loaded before forking, so no rank pays for it
from archon.errors import user_error_types
from archon.plan.params import read_model_config
from archon.runtime.fork_ranks import RankError, run_ranks
from archon.sft import loss_token_count, sft_loss_fn
from models.model_args import read_num_experts
from pipeline.schedules import microbatch_count, required_stages_per_rank

if TYPE_CHECKING:
    from archon.config import Config, TrainEngineConfig

TOLERANCE = 1e-4
"""Largest relative difference of a step's loss or gradient norm that still counts as equal."""


class RehearsalError(RuntimeError):
    """A rank of the rehearsal failed; the message says which and why, ``details`` holds its traceback."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


@dataclass
class Rehearsal:
    """What the rehearsal trains: the shrunken model and the engine config, and what was changed."""

    hf_config: dict[str, Any]
    """config.json of the shrunken model."""
    engine: Any
    """The actor's engine config as the rehearsal runs it (TrainEngineConfig)."""
    sequences: int
    """Sequences per step."""
    changes: list[str] = field(default_factory=list)
    """One line per thing that differs from the configured run."""


@dataclass
class RehearsalResult:
    """Per-step stats of the layout and of one device, and the verdict."""

    layout: list[dict[str, float]]
    reference: list[dict[str, float]]
    seconds: float
    first_difference: str | None = None
    """None when every step agrees, else a sentence naming the step and the values."""

    @property
    def ok(self) -> bool:
        return self.first_difference is None


# ---------------------------------------------------------------------------------- shrinking


def _multiple(value: int, of: int) -> int:
    return max(of, math.ceil(value / of) * of)


def shrink(hf: dict[str, Any], engine: TrainEngineConfig) -> Rehearsal:
    """The smallest model of ``hf``'s type that ``engine.backend`` still splits, and the CPU engine config."""

    alloc = ModelAllocation.from_str(engine.backend)
    p = alloc.parallel
    tp, cp, pp, ep, etp = p.tp_size, p.cp_size, p.pp_size, p.ep_size, p.etp_size
    changes: list[str] = []
    arch = engine.archon
    per_rank = (required_stages_per_rank(arch.pp_schedule) or 2) if pp > 1 else 1
    n_stages = pp * per_rank
    layers = max(2, n_stages)
    heads0, kv0 = int(hf["num_attention_heads"]), int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    kv = tp
    heads = math.lcm(tp * cp, kv)
    if heads0 > kv0 and heads == kv:
        heads *= 2  # keep grouped-query attention
    small = dict(hf)
    small.update(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=16,
        hidden_size=32,
        intermediate_size=_multiple(32, tp),
        vocab_size=_multiple(128, tp),
        max_position_embeddings=256,
        torch_dtype="float32",
    )
    for stale in (
        "layer_types",
        "max_window_layers",
        "_name_or_path",
        "auto_map",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        small.pop(stale, None)
    what = [
        f"{layers} layers (was {hf['num_hidden_layers']})",
        f"{heads} heads / {kv} kv heads (was {heads0} / {kv0})",
        "hidden 32, head_dim 16, vocab " + str(small["vocab_size"]),
    ]
    experts = read_num_experts(hf) if "num_experts_per_tok" in hf else 0
    if experts:
        n_experts = max(ep, 2)
        small.update(
            num_experts=n_experts,
            num_experts_per_tok=min(int(hf["num_experts_per_tok"]), 2, n_experts),
            moe_intermediate_size=_multiple(16, max(tp, etp)),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        small.pop("num_local_experts", None)
        what.append(
            f"{n_experts} experts, top-{small['num_experts_per_tok']} (was {experts}, top-{hf['num_experts_per_tok']})"
        )
    changes.append("model: " + ", ".join(what))
    n_mbs = engine.mb_spec.n_mbs
    if pp > 1:
        mbs = microbatch_count(arch.pp_schedule, 1, n_stages, pp)
        if mbs != n_mbs:
            changes.append(
                f"mb_spec.n_mbs = {mbs} (was {n_mbs}): the fewest {arch.pp_schedule} runs with {n_stages} stages"
            )
    else:
        mbs = min(n_mbs, 2)
        if mbs != n_mbs:
            changes.append(f"mb_spec.n_mbs = {mbs} (was {n_mbs})")
    new_arch = dataclasses.replace(
        arch, enable_compile=False, use_deterministic_algorithms=False, pp_layers_per_stage=0
    )
    if arch.enable_compile:
        changes.append("archon.enable_compile = false (CPU)")
    if arch.use_deterministic_algorithms:
        changes.append("archon.use_deterministic_algorithms = false (GPU kernels only)")
    if arch.pp_layers_per_stage:
        changes.append(f"archon.pp_layers_per_stage = 0 (was {arch.pp_layers_per_stage}): one layer per stage")
    if engine.dtype != "float32":
        changes.append(f"dtype = float32 (was {engine.dtype}), for a 1e-4 comparison")
    optimizer = dataclasses.replace(engine.optimizer, lr=1e-2, warmup_steps=0, lr_schedule="constant")
    changes.append(f"optimizer.lr = 0.01 (was {engine.optimizer.lr:g}), constant: updates show in the next loss")
    small_engine = dataclasses.replace(
        engine,
        path="",
        model_config="",
        dtype="float32",
        pad_to_maximum=False,
        archon=new_arch,
        optimizer=optimizer,
        mb_spec=dataclasses.replace(engine.mb_spec, n_mbs=mbs, max_tokens_per_mb=0),
    )
    sequences = p.dp_size * mbs * 2
    return Rehearsal(small, small_engine, sequences, changes)


# ---------------------------------------------------------------------------------- running


def _batch(step: int, sequences: int, vocab: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7919 + step)
    lens = torch.randint(8, 25, (sequences,), generator=g).tolist()
    width = max(lens)
    ids = torch.zeros(sequences, width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(sequences, width)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        attn[i, :n] = 1
        mask[i, n // 2 : n] = 1.0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}


def _train(
    engine_cfg: Any, model_dir: str, steps: int, sequences: int, vocab: int, seed: int
) -> list[dict[str, float]]:
    # torch's pipeline runtime logs the whole schedule of every rank on a failure, and DTensor/FSDP warn
    # about CPU meshes once per rank; the report says what matters.
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.CRITICAL)
    warnings.simplefilter("ignore", UserWarning)
    cfg = dataclasses.replace(engine_cfg, model_config=model_dir)
    engine = ArchonEngine(cfg, seed=seed, device="cpu", total_steps=steps).initialize()
    stats = []
    for step in range(steps):
        out = engine.train_batch(_batch(step, sequences, vocab), sft_loss_fn, loss_token_count)
        stats.append({"loss": out["loss"], "grad_norm": out["grad_norm"]})
    return stats if dist.get_rank() == 0 else []


def _run_ranks(fn: Callable, world: int, *args: Any) -> list[Any]:
    """``fn(*args)`` on ``world`` forked processes that form a gloo group; their results by rank."""
    try:
        return run_ranks(fn, world, args, timeout_s=3600.0, group_timeout_s=30 * 60.0)
    except RankError as exc:
        raise RehearsalError(str(exc), exc.details) from exc


def _first_difference(layout: list[dict[str, float]], reference: list[dict[str, float]]) -> str | None:
    for step, (a, b) in enumerate(zip(layout, reference), start=1):
        for key in ("loss", "grad_norm"):
            if abs(a[key] - b[key]) > TOLERANCE * max(1.0, abs(b[key])):
                return (
                    f"step {step}: {key} {a[key]:.8g} under the layout but {b[key]:.8g} on one device "
                    f"(difference {abs(a[key] - b[key]):.3g})"
                )
    return None


def rehearse(cfg: Config, steps: int = 3) -> tuple[Rehearsal, RehearsalResult]:
    """Train the shrunken model under the actor's allocation and under archon:d1; compare the steps."""
    plan = shrink(read_model_config(cfg.actor), cfg.actor)
    world = ModelAllocation.from_str(plan.engine.backend).world_size
    vocab = int(plan.hf_config["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="archon-rehearsal-") as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(plan.hf_config, indent=1))
        start = time.perf_counter()
        layout = _run_ranks(_train, world, plan.engine, str(model_dir), steps, plan.sequences, vocab, cfg.seed)[0]
        one = dataclasses.replace(plan.engine, backend="archon:d1")
        reference = _run_ranks(_train, 1, one, str(model_dir), steps, plan.sequences, vocab, cfg.seed)[0]
        seconds = time.perf_counter() - start
    return plan, RehearsalResult(layout, reference, seconds, _first_difference(layout, reference))


def main(argv: Sequence[str]) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(
        prog="python -m archon.plan rehearse",
        description="Train a shrunken model of the actor's architecture under its "
        "allocation with one CPU process per rank and compare with one "
        "device (no GPU needed).",
    )
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3)")
    parser.add_argument("--traceback", action="store_true", help="print a failing rank's whole traceback")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    console = Console() if os.isatty(1) else Console(width=200)
    try:
        cfg = load_config(args.config, args.overrides, job="sft")
        world = cfg.allocations()["actor"].world_size
        console.print(
            f"rehearsing actor.backend = '{cfg.actor.backend}' with {world} CPU processes (gloo)", highlight=False
        )
        plan, result = rehearse(cfg, args.steps)
    except user_error_types() as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    except RehearsalError as exc:
        err = Console(stderr=True)
        err.print(
            f"[bold red]the layout failed to train:[/] {exc}"
            + ("" if args.traceback else " (--traceback shows where)"),
            highlight=False,
        )
        if args.traceback:
            err.print(exc.details, highlight=False, markup=False)
        return 1
    console.print("changed for the rehearsal:", highlight=False)
    for line in plan.changes:
        console.print(f"  {line}", highlight=False)
    for i, (a, b) in enumerate(zip(result.layout, result.reference), start=1):
        console.print(
            f"  step {i}: loss {a['loss']:.6f} (one device {b['loss']:.6f}), grad norm "
            f"{a['grad_norm']:.6f} ({b['grad_norm']:.6f})",
            highlight=False,
        )
    if result.ok:
        console.print(
            f"[bold green]the layout trains like one device[/] ({len(result.layout)} steps within "
            f"{TOLERANCE:g}, {result.seconds:.0f} s)",
            highlight=False,
        )
        return 0
    console.print(f"[bold red]the layout differs from one device:[/] {result.first_difference}", highlight=False)
    return 1
