"""Benchmark of FP8 training (torchao float8, ``actor.archon.fp8``) against bf16 on the same Archon engine.

    python scripts/bench_fp8.py --device cuda --preset qwen3-0.6b --compile both --curve-steps 300   # H100/H200
    python scripts/bench_fp8.py --quick        # CPU smoke run: emulated fp8 is slower than bf16, by design

Every side is ``ArchonEngine`` (``archon:d1``, one process) on the same random Qwen3 (built from a config,
nothing is downloaded), the same tokens and the same AdamW: bf16 (autocast dtype, float32 master weights), and
each fp8 recipe on top of it.  Throughput: sides alternate step by step on one batch (median tokens/s, and the
median of the paired ratios to bf16).  Loss curve: each side trains ``--curve-steps`` steps on a fixed cycle of
batches from the same start; the table gives the loss of the last steps and the largest relative gap to bf16
along the way (FP8 should track bf16 within a few per mille once past the first steps).

FP8 matmuls need CUDA compute capability 8.9+ (H100/H200); elsewhere torchao emulates them (correct, slow):
figures from an emulated run say nothing about speed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
from bench_common import interleaved, machine_note, markdown_table, median_ratio
from bench_train import _PRESETS, Shape, make_batch

_CPU_SHAPE = Shape(hidden=256, layers=4, intermediate=768, vocab=4096)
"""A CPU-sized model whose linears all take FP8 (sizes are multiples of 16)."""


def _nll(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
    mask = mb["loss_mask"]
    return -(outputs["logprobs"] * mask).sum() / mask.sum(), {}


def fp8_capable(device: str) -> bool:
    """Whether ``device`` has FP8 matmuls (CUDA compute capability 8.9+)."""
    return device.startswith("cuda") and torch.cuda.get_device_capability() >= (8, 9)


def build_side(folder: str, device: str, recipe: str, compile_: bool, max_tokens: int):
    """An ``ArchonEngine`` in bf16, with ``recipe`` ('' = none) as its fp8 recipe (emulated where it must be)."""
    from archon.config import ArchonEngineConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from archon.engine.engine import ArchonEngine

    cfg = TrainEngineConfig(
        backend="archon:d1",
        path=folder,
        dtype="bfloat16",
        archon=ArchonEngineConfig(enable_compile=compile_, fp8=cast(Any, recipe), fp8_emulate=not fp8_capable(device)),
        optimizer=OptimizerConfig(lr=3e-4, warmup_steps=10),
        # Under compile rows are padded to one length (one graph).
        mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens if compile_ else 0),
    )
    return ArchonEngine(cfg, device=device, total_steps=100_000).initialize()


def train_step(engine, batch: dict[str, torch.Tensor]) -> float:
    """One optimizer step of ``engine`` on ``batch``; its loss."""
    return engine.train_batch(batch, _nll, lambda mb: float(mb["loss_mask"].sum()))["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--preset", choices=sorted(_PRESETS), help="a named model shape (default: a CPU-sized one)")
    parser.add_argument("--recipes", default="tensorwise,rowwise", help="comma list of torchao float8 recipes")
    parser.add_argument("--compile", choices=("off", "on", "both"), default="off", help="torch.compile the blocks")
    parser.add_argument("--seqs", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048 CUDA, 128 CPU)")
    parser.add_argument("--reps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--curve-steps", type=int, default=0, help="steps of the loss-curve comparison (0: none)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: 3 timed steps, 10 curve steps")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    shape = _PRESETS[args.preset] if args.preset else _CPU_SHAPE
    seq_len = args.seq_len or (2048 if cuda else 128)
    reps, curve = (3, 10) if args.quick else (args.reps, args.curve_steps)
    recipes = [r for r in args.recipes.split(",") if r]
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if not fp8_capable(args.device):
        print("NOTE: no FP8 matmuls on this device: fp8 is emulated (correct, slow); the times say nothing of speed")
    with tempfile.TemporaryDirectory() as folder:
        shape.write(folder, max_positions=max(8192, seq_len))
        batch = make_batch("full", args.seqs, seq_len, shape.vocab)
        tokens = int(batch["attention_mask"].sum())
        rows = []
        for compile_ in compiles:
            sides = {name: build_side(folder, args.device, name, compile_, seq_len) for name in ["", *recipes]}
            for engine in sides.values():  # warm-up (compile, torchao's first casts)
                train_step(engine, batch)
            steps: dict[str, Callable[[], object]] = {n: partial(train_step, e, batch) for n, e in sides.items()}
            times = interleaved(steps, reps, sync)
            for name, ts in times.items():
                ratio = median_ratio(times[""], ts)
                tps = tokens / statistics.median(ts)
                rows.append([name or "bf16", "on" if compile_ else "off", f"{tps:,.0f}", f"{ratio:.2f}x"])
            del sides
        print(f"\n{shape.name}, {args.seqs} x {seq_len} tokens per step, {args.device}; {machine_note()}")
        print(markdown_table(["side", "compile", "tokens/s", "speed vs bf16"], rows))
        if curve:
            batches = [make_batch("full", args.seqs, seq_len, shape.vocab, seed=s) for s in range(8)]
            losses = {}
            for name in ["", *recipes]:
                engine = build_side(folder, args.device, name, False, seq_len)
                losses[name] = [train_step(engine, batches[s % len(batches)]) for s in range(curve)]
                del engine
            ref = losses[""]
            curve_rows = []
            for name, ls in losses.items():
                gap = max(abs(a - b) / abs(b) for a, b in zip(ls, ref))
                last = statistics.mean(ls[-min(10, len(ls)) :])
                curve_rows.append([name or "bf16", f"{ls[0]:.4f}", f"{last:.4f}", f"{gap:.2e}"])
            print(f"\nloss over {curve} steps (8 fixed batches in turn), eager")
            print(markdown_table(["side", "first loss", "mean of the last 10", "max relative gap to bf16"], curve_rows))


if __name__ == "__main__":
    main()
