"""Benchmark of one engine training step: bfloat16 compute against float32, in the same run.

    python scripts/bench_train.py [--hidden 512] [--layers 4] [--tokens 4096] [--steps 5]

Builds a random Qwen3 locally (nothing is downloaded) and trains it with ``ArchonEngine``
(``archon:d1``, one process) on packed random sequences, first with ``actor.dtype = float32``
(the baseline) and then with ``bfloat16``; prints tokens/s of each and the ratio.  On CPUs
with AVX-512 bf16 the matmuls run ~2.6x faster in bf16; the whole step gains less.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def _make_model(folder: str, hidden: int, layers: int, vocab: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
                                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                  head_dim=hidden // 8, max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _batch(tokens: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < tokens:
        lens.append(int(torch.randint(64, 512, (1,), generator=g)))
    width = max(lens)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.randint(0, vocab, (n,), generator=g)
        mask[b, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.float()}


def _loss(outputs, mb):
    mask = mb["loss_mask"]
    return -(outputs["logprobs"] * mask).sum() / mask.sum(), {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (packed)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per dtype (after one warm-up step)")
    args = parser.parse_args()

    from archon.config import ArchonEngineConfig, OptimizerConfig, TrainEngineConfig
    from archon.engine.engine import ArchonEngine

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        _make_model(folder, args.hidden, args.layers, args.vocab)
        for dtype in ("float32", "bfloat16"):
            cfg = TrainEngineConfig(backend="archon:d1", path=folder, dtype=dtype,
                                    archon=ArchonEngineConfig(enable_compile=False),
                                    optimizer=OptimizerConfig(lr=1e-4))
            engine = ArchonEngine(cfg, total_steps=args.steps + 1).initialize()
            engine.train_batch(_batch(args.tokens, args.vocab, 0), _loss, lambda mb: float(mb["loss_mask"].sum()))
            t0 = time.perf_counter()
            n_tokens = 0.0
            for step in range(args.steps):
                stats = engine.train_batch(_batch(args.tokens, args.vocab, step + 1), _loss,
                                           lambda mb: float(mb["loss_mask"].sum()))
                n_tokens += stats["tokens"]
            results[dtype] = n_tokens / (time.perf_counter() - t0)
    print(f"model: qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"~{args.tokens} packed tokens per step; torch threads {torch.get_num_threads()}")
    print(f"float32 (baseline): {results['float32']:9.1f} tokens/s")
    print(f"bfloat16:           {results['bfloat16']:9.1f} tokens/s")
    print(f"ratio: {results['bfloat16'] / results['float32']:.2f}x")


if __name__ == "__main__":
    main()
