"""Shared pieces of the ``bench_*.py`` scripts: a random Qwen3 folder, interleaved timing, tables.

Benchmarks run Archon and its peer in one process and alternate them repetition by
repetition (A B, B A, A B, ...), so both see the same machine load; they report medians and
the median of the per-repetition ratios, which stays meaningful on a shared machine where
absolute timings drift.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch


def make_qwen3(
    folder: str,
    hidden: int,
    layers: int,
    vocab: int,
    *,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int | None = None,
    intermediate: int | None = None,
    tie: bool = False,
    max_positions: int = 8192,
    seed: int = 0,
) -> None:
    """Write a random Qwen3 (config.json + safetensors) built from a config; nothing is downloaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock`` choices: wall time, or CPU seconds of this process (all its threads).  On a loaded
machine, CPU time with one torch thread counts the work done, not the wait for a core."""


def interleaved(
    fns: Mapping[str, Callable[[], object]], reps: int, sync: Callable[[], None] = lambda: None, clock: str = "wall"
) -> dict[str, list[float]]:
    """Seconds of ``reps`` calls of every function, in an order that rotates each repetition."""
    now = CLOCKS[clock]
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            t0 = now()
            fns[name]()
            sync()
            times[name].append(now() - t0)
    return times


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over repetitions of ``numerator[i] / denominator[i]`` (paired: same load)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def matmul_flops_per_s(
    dtype: torch.dtype, device: str = "cpu", n: int = 2048, iters: int = 2, clock: str = "wall"
) -> float:
    """This machine's matmul peak right now, in FLOP/s: the best of ``iters`` ``n x n x n`` products.

    On CPU both kernels PyTorch can use count: its BLAS (``torch.mm``; MKL in the official
    wheels) and oneDNN (``mkldnn::_linear_pointwise``), which on some CPUs is twice as fast in
    float32; the peak is the faster one, so an MFU never credits a slow library.
    """
    now = CLOCKS[clock]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    kernels = [lambda: a @ b]
    onednn = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if device == "cpu" and onednn is not None and torch.backends.mkldnn.is_available():
        kernels.append(lambda: onednn(a, b, None, "none", [], ""))
    best = float("inf")
    for kernel in kernels:
        for _ in range(iters):
            sync()
            t0 = now()
            kernel()
            sync()
            best = min(best, now() - t0)
    return 2 * n**3 / best


def machine_note(clock: str = "wall") -> str:
    """Threads, cores, the load average and the clock, to print with every table."""
    load = os.getloadavg()
    note = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
        f"load average {', '.join(f'{x:.1f}' for x in load)}, {'wall' if clock == 'wall' else 'CPU'} time"
    )
    if clock == "wall" and load[0] > (os.cpu_count() or 1):
        note += (
            "\nWARNING: the machine is busier than its cores; wall times (and multi-threaded kernels) "
            "are unreliable here: rerun with --threads 1 --clock cpu"
        )
    return note


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-markdown table (pastes into the README as is)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])
