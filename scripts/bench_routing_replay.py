"""What MoE routing replay buys: train/inference logprob mismatch with replay off and on, in one run.

    python scripts/bench_routing_replay.py [--experts 16] [--top-k 2] [--layers 4] [--samples 32]

Builds a random Qwen3-MoE locally (nothing is downloaded), serves it with the built-in
rollout engine in bfloat16 (weights in bf16, KV-cache decode, as a rollout server runs), samples
completions with ``return_routed_experts``, then recomputes the sampled tokens' logprobs with
the trainer (``ArchonEngine``, ``archon:d1``, ``actor.dtype = bfloat16``: float32 master
weights under autocast, packed prefill), first routing freely and then replaying the server's
expert choices (``actor.moe_routing_replay``).  Prints, for each, the mean and max
|trainer logprob - server logprob| over the sampled tokens (the ``behav_prox_logprob_diff``
metric of an RL run), the fraction of (token, layer) routing decisions where the trainer's own
choice differs from the server's, and the ratio of the mean mismatches.
"""

from __future__ import annotations

import argparse
import tempfile

import torch


def _make_model(folder: str, args: argparse.Namespace) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        moe_intermediate_size=args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            # A trained router is decisive; transformers' init (std 0.02) would make every
            # token's experts a near tie.
            layer.mlp.gate.weight.normal_(0.0, args.gate_std)
    model.save_pretrained(folder)


def _rollout(folder: str, args: argparse.Namespace):
    from archon.server.generator import GenerationRequest, Generator
    from archon.server.sampling import SamplingParams

    g = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(0, args.vocab, (int(torch.randint(8, 32, (1,), generator=g)),), generator=g).tolist()
        for _ in range(args.samples)
    ]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    with Generator.from_hf(folder, dtype=torch.bfloat16, random_seed=args.seed, max_running_requests=16) as gen:
        results = gen.generate(
            [GenerationRequest(p, params, return_logprob=True, return_routed_experts=True) for p in prompts]
        )
    return prompts, results


def _batch(prompts, results):
    from archon.rl.rollout_batch import Completion, build_rollout_batch

    completions = [
        Completion(p, r.output_ids, r.output_logprobs, "length", r.routed_experts.numpy())
        for p, r in zip(prompts, results)
    ]
    return build_rollout_batch(completions, [0.0] * len(completions))


def _trainer(folder: str):
    from archon.config import ActorConfig, ArchonEngineConfig, MicroBatchSpec
    from archon.engine.engine import ArchonEngine

    cfg = ActorConfig(
        backend="archon:d1",
        path=folder,
        dtype="bfloat16",
        moe_routing_replay=True,
        archon=ArchonEngineConfig(enable_compile=False),
        mb_spec=MicroBatchSpec(n_mbs=1),
    )
    return ArchonEngine(cfg, trainable=False, device="cpu").initialize()


def _own_choices(engine, batch) -> torch.Tensor:
    """The trainer's own routing of every (token, layer): ``[B, S, layers, top_k]`` (packed forward, one row each)."""
    from archon.engine.moe_balance import moe_layers

    layers = moe_layers(engine.model)
    for _, moe in layers:
        moe.record_routing = True
    b, s = batch["input_ids"].shape
    k = layers[0][1].top_k
    out = torch.full((b, s, engine.model_args.n_layers, k), -1, dtype=torch.int64)
    lens = batch["attention_mask"].sum(1).tolist()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for row, n in enumerate(lens):
            engine.model(batch["input_ids"][row : row + 1, :n])
            for i, moe in layers:
                assert moe.selected_experts is not None  # record_routing is on
                out[row, :n, i] = moe.selected_experts[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks (all MoE)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per layer")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--gate-std", type=float, default=0.1, help="std of the random router weights")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    parser.add_argument("--samples", type=int, default=32, help="completions sampled")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, prompts and sampling")
    args = parser.parse_args()

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as folder:
        _make_model(folder, args)
        prompts, results = _rollout(folder, args)
        batch = _batch(prompts, results)
        engine = _trainer(folder)
        mask = batch["loss_mask"].bool()
        server = batch["logprobs"][mask]
        free_batch = {k: v for k, v in batch.items() if k != "routed_experts"}
        rows = {}
        for name, b in (("off", free_batch), ("on", batch)):
            diff = (engine.forward(b)["logprobs"][mask] - server).abs()
            rows[name] = (float(diff.mean()), float(diff.max()))
        own = _own_choices(engine, batch)
        served = batch["routed_experts"].long()
        known = served[..., 0] >= 0
        differ = (own.sort(-1).values != served.sort(-1).values).any(-1) & known
        flip_frac = float(differ.sum() / known.sum())

    print(
        f"tiny Qwen3-MoE: {args.layers} layers x {args.experts} experts (top-{args.top_k}), hidden {args.hidden}, "
        f"bfloat16; {int(mask.sum())} sampled tokens from {args.samples} completions"
    )
    print(f"routing decisions (token, layer) where the trainer's own choice differs from the server's: {flip_frac:.2%}")
    print(f"{'routing replay':<16}{'mean |dlogp|':>14}{'max |dlogp|':>14}")
    for name, (mean, top) in rows.items():
        print(f"{name:<16}{mean:>14.4g}{top:>14.4g}")
    ratio = rows["off"][0] / rows["on"][0] if rows["on"][0] > 0 else float("inf")
    print(f"replay cuts the mean train/inference mismatch {ratio:.2f}x")


if __name__ == "__main__":
    main()
