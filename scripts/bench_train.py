"""Benchmark of one training step, Archon against Hugging Face transformers, in the same run.

    python scripts/bench_train.py            # CPU: hidden 256/4 layers and 512/8 layers, fp32 and bf16
    python scripts/bench_train.py --quick    # CPU: hidden 256/4 layers only (under a minute)
    python scripts/bench_train.py --device cuda --preset qwen3-0.6b [--compile both]   # GPU

A step is forward + backward + gradient clipping + AdamW on the same random Qwen3 (built from a
config, nothing is downloaded), the same weights, the same tokens and the same optimizer
(``archon.engine.optimizer.build_optimizer`` for both): Archon's ``ArchonEngine``
(``archon:d1``, one process; sequences packed into one row) against ``AutoModelForCausalLM``
(padded batch, its best attention: SDPA, or FlashAttention-2 on CUDA when installed) with its
own loss (``labels=``).  Archon's loss is the same masked mean of the next-token NLL, from the
per-token logprobs the RL losses use.  bf16 means autocast over float32 weights on both sides.

Two batches: "full" (every sequence ``--seq-len`` tokens) and "mixed" (lengths uniform in
``[seq-len/8, seq-len]``, fixed seed).  The two sides alternate step by step; the table gives
median tokens/s of each and the median of the per-step ratios.  MFU is model FLOPs (matmuls:
6 x weights x tokens; attention: causal, 6 x heads x head_dim x sum(len^2) per layer) over
the matmul peak of the step's dtype measured between the steps (CPU: the faster of BLAS and
oneDNN) or the GPU's bf16
spec-sheet peak (CUDA).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from dataclasses import dataclass
from typing import Literal, cast

import torch
from bench_common import interleaved, machine_note, make_qwen3, markdown_table, matmul_flops_per_s, median_ratio

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' spec sheets.
_GPU_BF16_PEAK = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


@dataclass
class Shape:
    """A Qwen3 shape to benchmark."""

    hidden: int
    layers: int
    heads: int = 8
    kv_heads: int = 4
    head_dim: int | None = None
    intermediate: int | None = None
    vocab: int = 8192
    tie: bool = False

    @property
    def name(self) -> str:
        return f"h{self.hidden} x {self.layers}L"

    def write(self, folder: str, max_positions: int = 8192) -> None:
        """A random Qwen3 of this shape into ``folder`` (``bench_common.make_qwen3``)."""
        make_qwen3(
            folder,
            self.hidden,
            self.layers,
            self.vocab,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate=self.intermediate,
            tie=self.tie,
            max_positions=max_positions,
        )


_PRESETS = {
    # Qwen3-0.6B's architecture (config.json of Qwen/Qwen3-0.6B), random weights.
    "qwen3-0.6b": Shape(
        hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936, tie=True
    )
}


def make_batch(kind: str, n_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``; ``loss_mask`` marks tokens that are next-token targets."""
    g = torch.Generator().manual_seed(seed)
    if kind == "full":
        lens = [seq_len] * n_seqs
    else:
        lens = torch.randint(max(2, seq_len // 8), seq_len + 1, (n_seqs,), generator=g).tolist()
    ids = torch.zeros(n_seqs, max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.randint(0, vocab, (n,), generator=g)
        mask[b, :n] = 1
    loss_mask = mask.float()
    loss_mask[:, 0] = 0.0  # a sequence's first token is nobody's target (as with HF's shifted labels)
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def model_flops(shape: Shape, lens: list[int]) -> float:
    """Training FLOPs of one step (forward + backward) on sequences of lengths ``lens``."""
    head_dim = shape.head_dim or shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    per_layer = shape.hidden * (2 * q + 2 * kv) + 3 * shape.hidden * (shape.intermediate or 3 * shape.hidden)
    weights = shape.layers * per_layer + shape.hidden * shape.vocab  # + LM head; embeddings are lookups
    attention = 6 * shape.layers * q * sum(n * n for n in lens)  # causal: half of 12 * s^2 * q
    return 6 * weights * sum(lens) + attention


def _nll_loss(outputs, mb):
    mask = mb["loss_mask"]
    return -(outputs["logprobs"] * mask).sum() / mask.sum(), {}


class ArchonSide:
    """``ArchonEngine`` on one process; ``step()`` trains on the batch once and returns the loss."""

    def __init__(self, folder: str, dtype: str, device: str, compile_: bool, max_tokens: int):
        from archon.config import ArchonEngineConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
        from archon.engine.engine import ArchonEngine

        cfg = TrainEngineConfig(
            backend="archon:d1",
            path=folder,
            dtype=cast(Literal["float32", "bfloat16", "float16"], dtype),  # --dtypes' choices
            archon=ArchonEngineConfig(enable_compile=compile_),
            optimizer=OptimizerConfig(lr=1e-5),
            # Under compile rows are padded to one length (one graph).
            mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens if compile_ else 0),
        )
        self.engine = ArchonEngine(cfg, device=device, total_steps=1000).initialize()

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        return self.engine.train_batch(batch, _nll_loss, lambda mb: float(mb["loss_mask"].sum()))["loss"]


class HFSide:
    """``AutoModelForCausalLM`` with its own loss, the same optimizer, clipping and autocast."""

    def __init__(self, folder: str, dtype: str, device: str, compile_: bool):
        from transformers import AutoModelForCausalLM

        from archon.config import OptimizerConfig
        from archon.engine.optimizer import build_optimizer

        self.attn = _best_hf_attention(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation=self.attn, dtype=torch.float32
        ).to(device)  # pyright: ignore[reportArgumentType] - transformers' .to typing
        self.model.train()
        if compile_:
            self.model.compile()
        self.device = device
        self.amp = torch.bfloat16 if dtype == "bfloat16" else None
        self.optimizer = build_optimizer(self.model.parameters(), OptimizerConfig(lr=1e-5))

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device)
        labels = ids.masked_fill(mask == 0, -100)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.split(":")[0], dtype=self.amp or torch.float32, enabled=self.amp is not None):
            loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return float(loss.detach())


def _best_hf_attention(device: str) -> str:
    if device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401  # pyright: ignore[reportMissingImports] - optional

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def _gpu_peak(device: str) -> tuple[float, str]:
    name = torch.cuda.get_device_name(device)
    for key, peak in _GPU_BF16_PEAK.items():
        if key in name:
            return peak, f"{name}, bf16 spec-sheet peak {peak / 1e12:.0f} TFLOP/s"
    peak = matmul_flops_per_s(torch.bfloat16, device, n=8192, iters=5)
    return peak, f"{name}, measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s"


def run_case(folder: str, shape: Shape, dtype: str, kinds: list[str], args, compile_: bool = False) -> list[dict]:
    """Benchmark one (shape, dtype): both sides built once, each batch kind timed interleaved."""
    device = args.device
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batches = {k: make_batch(k, args.seqs, args.seq_len, shape.vocab, seed=1) for k in kinds}
    archon = ArchonSide(folder, dtype, device, compile_, args.seqs * args.seq_len)
    hf = HFSide(folder, dtype, device, compile_)
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    rows = []
    for kind, batch in batches.items():
        # Warm-up (compile, allocator); the first losses show both sides compute the same function.
        loss_a, loss_h = archon.step(batch), hf.step(batch)
        for _ in range(args.warmup - 1):
            archon.step(batch)
            hf.step(batch)
        peak_mem = {}

        def timed(side, name, batch, peak_mem):
            def fn():
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                side.step(batch)
                if cuda:
                    peak_mem[name] = max(peak_mem.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)

            return fn

        fns = {"archon": timed(archon, "archon", batch, peak_mem), "hf": timed(hf, "hf", batch, peak_mem)}
        if not cuda:  # the matmul peak, measured between the steps under the same load
            peaks: list[float] = []
            fns["peak"] = lambda peaks=peaks: peaks.append(
                matmul_flops_per_s(torch_dtype, n=args.peak_n, clock=args.clock)
            )
        times = interleaved(fns, args.reps, sync, args.clock)
        lens = batch["attention_mask"].sum(1).tolist()
        tokens, flops = sum(lens), model_flops(shape, lens)
        if cuda:
            peak, _ = _gpu_peak(device)
            mfu = {s: flops / statistics.median(times[s]) / peak for s in ("archon", "hf")}
        else:
            mfu = {s: statistics.median(flops / t / p for t, p in zip(times[s], peaks)) for s in ("archon", "hf")}
        rows.append(
            {
                "shape": shape.name,
                "dtype": dtype,
                "batch": f"{kind} {len(lens)}x{args.seq_len}",
                "compile": compile_,
                "hf": tokens / statistics.median(times["hf"]),
                "archon": tokens / statistics.median(times["archon"]),
                "ratio": median_ratio(times["hf"], times["archon"]),
                "mfu_archon": mfu["archon"],
                "mfu_hf": mfu["hf"],
                "loss_diff": abs(loss_a - loss_h),
                "mem": peak_mem,
                "attn": hf.attn,
                "peak": statistics.median(peaks) if not cuda else None,
            }
        )
    del archon, hf
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="hidden 256/4 layers only, 3 repetitions")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--preset", choices=sorted(_PRESETS), help="a named model shape instead of the CPU ones")
    parser.add_argument(
        "--dtypes", default=None, help="comma list of float32,bfloat16 (default: both on CPU, bfloat16 on CUDA)"
    )
    parser.add_argument("--batches", default="full,mixed", help="comma list of full,mixed")
    parser.add_argument("--seqs", type=int, default=None, help="sequences per step (default 8 on CPU, 4 on CUDA)")
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per full-length sequence (default 256 on CPU, 2048 on CUDA)"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed steps per side and batch (default 5, quick 3)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per side first (default 1; 3 under compile)"
    )
    parser.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        default="off",
        help="torch.compile both sides (Archon: per block; HF: the model)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or CPU time of the process (with --threads 1 on a loaded machine)",
    )
    parser.add_argument("--peak-n", type=int, default=2048, help="matmul size of the CPU peak measurement")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    args.seqs = args.seqs or (4 if cuda else 8)
    args.seq_len = args.seq_len or (2048 if cuda else 256)
    args.reps = args.reps or (3 if args.quick else 5)
    args.warmup = args.warmup or (3 if args.compile != "off" else 1)
    dtypes = (args.dtypes or ("bfloat16" if cuda else "float32,bfloat16")).split(",")
    kinds = args.batches.split(",")
    if args.preset:
        shapes = [_PRESETS[args.preset]]
    elif args.quick:
        shapes = [Shape(256, 4)]
    else:
        shapes = [Shape(256, 4), Shape(512, 8)]
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]

    rows = []
    for shape in shapes:
        with tempfile.TemporaryDirectory() as folder:
            shape.write(folder, max_positions=max(8192, args.seq_len))
            for compile_ in compiles:
                for dtype in dtypes:
                    rows.extend(run_case(folder, shape, dtype, kinds, args, compile_))

    print(
        "training step (forward + backward + clip + AdamW), Archon archon:d1 vs HF transformers; "
        f"{machine_note(args.clock)}"
    )
    if cuda:
        print(f"device: {_gpu_peak(args.device)[1]}; HF attention: {rows[0]['attn']}")
    headers = (
        ["model", "dtype", "batch"]
        + (["compile"] if args.compile != "off" else [])
        + ["HF tok/s", "Archon tok/s", "Archon/HF", "Archon MFU", "HF MFU"]
        + (["peak mem GiB (Archon/HF)"] if cuda else [])
    )
    table = []
    for r in rows:
        cells = [r["shape"], r["dtype"], r["batch"]] + (
            ["on" if r["compile"] else "off"] if args.compile != "off" else []
        )
        cells += [
            f"{r['hf']:,.0f}",
            f"{r['archon']:,.0f}",
            f"{r['ratio']:.2f}x",
            f"{r['mfu_archon']:.2f}",
            f"{r['mfu_hf']:.2f}",
        ]
        if cuda:
            cells.append(f"{r['mem'].get('archon', 0):.1f} / {r['mem'].get('hf', 0):.1f}")
        table.append(cells)
    print(markdown_table(headers, table))
    if not cuda:
        for dtype in dtypes:
            peaks = [r["peak"] for r in rows if r["dtype"] == dtype]
            print(
                f"measured {dtype} matmul peak ({args.peak_n}^3, best of BLAS and oneDNN): "
                f"{statistics.median(peaks) / 1e9:,.0f} GFLOP/s (median; MFU uses the one measured beside each step)"
            )
    for shape in shapes:
        for kind in kinds:
            pick = {
                r["dtype"]: r["archon"]
                for r in rows
                if r["shape"] == shape.name and r["batch"].startswith(kind) and not r["compile"]
            }
            if "float32" in pick and "bfloat16" in pick:
                print(f"Archon bf16 / fp32 tokens/s, {shape.name}, {kind}: {pick['bfloat16'] / pick['float32']:.2f}x")
    worst = {dtype: max(r["loss_diff"] for r in rows if r["dtype"] == dtype) for dtype in dtypes}
    print(
        "first-step loss |Archon - HF| (the same function on the same weights and tokens): "
        + ", ".join(f"{dtype} at most {diff:.1e}" for dtype, diff in worst.items())
    )
    if torch.distributed.is_initialized():  # the engines joined a one-rank group; NCCL warns if it is left open
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
