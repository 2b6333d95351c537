"""Benchmark of decoding: Archon's built-in rollout engine against transformers ``generate``, in one run.

    python scripts/bench_decode.py [--quick] [--batches 1,16] [--new-tokens 64] [--threads 1 --clock cpu]

Builds a random Qwen3 (hidden 256, 4 layers by default; nothing is downloaded) and, for each
batch size, generates ``--new-tokens`` greedy tokens after the same ``--prompt-len``-token
prompts with (a) ``archon.server.generator.Generator`` (the engine behind the built-in
server, without HTTP; it also returns every token's logprob, as RL needs) and (b)
``AutoModelForCausalLM.generate`` with its KV cache (``DynamicCache``).  The two alternate
repetition by repetition; the table gives median new tokens/s and the median of the
per-repetition ratios, and checks that the greedy outputs are identical (in float32; in
bfloat16 it reports how many tokens agree, as the two compute attention in different precisions).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from bench_common import interleaved, machine_note, make_qwen3, markdown_table, median_ratio


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens generated before each row's first difference."""
    same = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / max(1, sum(len(x) for x in a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repetitions")
    parser.add_argument("--batches", default="1,16", help="comma list of batch sizes (concurrent requests)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights of both sides")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7, quick 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or CPU time of the process (with --threads 1 on a loaded machine)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.reps or (3 if args.quick else 7)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    from transformers import AutoModelForCausalLM

    from archon.server.generator import GenerationRequest, Generator
    from archon.server.sampling import SamplingParams

    rows = []
    all_same = True
    with tempfile.TemporaryDirectory() as folder:
        # config.json's EOS id lies outside the small vocabulary: every request runs to max_new_tokens.
        make_qwen3(folder, args.hidden, args.layers, args.vocab, tie=True)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        with Generator.from_hf(folder, dtype=dtype, max_running_requests=max(map(int, args.batches.split(",")))) as gen:
            for batch in map(int, args.batches.split(",")):
                prompts = torch.randint(
                    0, args.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch)
                )
                outputs: dict[str, list[list[int]]] = {}

                def archon(prompts: torch.Tensor = prompts, outputs: dict[str, list[list[int]]] = outputs) -> None:
                    results = gen.generate(
                        [GenerationRequest(p.tolist(), params, return_logprob=True) for p in prompts]
                    )
                    outputs["archon"] = [r.output_ids for r in results]

                def transformers(
                    prompts: torch.Tensor = prompts, outputs: dict[str, list[list[int]]] = outputs
                ) -> None:
                    with torch.inference_mode():
                        out = hf.generate(  # pyright: ignore[reportAttributeAccessIssue] - transformers' typing
                            prompts,
                            attention_mask=torch.ones_like(prompts),
                            do_sample=False,
                            max_new_tokens=args.new_tokens,
                            pad_token_id=0,
                        )
                    outputs["hf"] = out[:, args.prompt_len :].tolist()

                archon()  # warm-up
                transformers()
                times = interleaved({"archon": archon, "hf": transformers}, reps, clock=args.clock)
                same = outputs["archon"] == outputs["hf"]
                all_same &= same
                agree = _agreement(outputs["archon"], outputs["hf"])
                tokens = batch * args.new_tokens
                rows.append(
                    [
                        str(batch),
                        f"{tokens / statistics.median(times['hf']):,.0f}",
                        f"{tokens / statistics.median(times['archon']):,.0f}",
                        f"{median_ratio(times['hf'], times['archon']):.2f}x",
                        "yes" if same else f"no ({agree:.0%} of tokens before the first difference)",
                    ]
                )

    print(
        f"greedy decode, Archon built-in engine vs transformers generate; qwen3 hidden {args.hidden}, "
        f"{args.layers} layers, {args.dtype}, prompt {args.prompt_len} + {args.new_tokens} new tokens; "
        f"{machine_note(args.clock)}"
    )
    print(markdown_table(["batch", "HF new tok/s", "Archon new tok/s", "Archon/HF", "greedy identical"], rows))
    if not all_same:
        if dtype == torch.float32:
            raise SystemExit("greedy outputs differ between Archon and transformers in float32")
        print("(low precision: attention runs in float32 on KV-cache steps, so near-ties may resolve differently)")


if __name__ == "__main__":
    main()
