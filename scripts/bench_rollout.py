"""Benchmark of the built-in rollout engine: continuous batching against one request at a time.

    python scripts/bench_rollout.py [--requests 32] [--max-new-tokens 64] [--hidden 256] [--dtype float32]

Builds a small random Qwen3 locally (nothing is downloaded), then generates the same
requests twice in one process: first one at a time (the baseline), then all submitted
together (continuous batching with a shared KV cache).  Prints tokens/s of each and their
ratio; the greedy outputs of both must be identical (checked), so the speed-up is free.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def _make_model(folder: str, hidden: int, layers: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32, help="number of requests")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weight dtype")
    args = parser.parse_args()

    from archon.server.generator import GenerationRequest, Generator
    from archon.server.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, 4096, (int(n),), generator=g).tolist()
        for n in torch.randint(16, 128, (args.requests,), generator=g)
    ]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)

    def requests() -> list[GenerationRequest]:
        return [GenerationRequest(list(p), params, return_logprob=True) for p in prompts]

    with tempfile.TemporaryDirectory() as folder:
        _make_model(folder, args.hidden, args.layers)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        with Generator.from_hf(folder, dtype=dtype, max_running_requests=args.requests) as gen:
            gen.generate(requests()[:2])  # warm-up: allocator, kernels
            t0 = time.perf_counter()
            sequential = [gen.generate([r])[0] for r in requests()]
            t_seq = time.perf_counter() - t0
            t0 = time.perf_counter()
            batched = gen.generate(requests())
            t_batch = time.perf_counter() - t0
    tokens = args.requests * args.max_new_tokens
    same = all(a.output_ids == b.output_ids for a, b in zip(sequential, batched))
    print(
        f"model: qwen3 hidden {args.hidden}, {args.layers} layers, {args.dtype}; "
        f"{args.requests} requests x {args.max_new_tokens} new tokens, torch threads {torch.get_num_threads()}"
    )
    print(f"one at a time (baseline): {tokens / t_seq:9.1f} tokens/s  ({t_seq:.2f} s)")
    print(f"continuous batching:      {tokens / t_batch:9.1f} tokens/s  ({t_batch:.2f} s)")
    print(f"ratio: {t_seq / t_batch:.2f}x; greedy outputs identical: {same}")


if __name__ == "__main__":
    main()
