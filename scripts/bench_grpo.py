"""Benchmark of one GRPO step: Archon's RL trainer against TRL's ``GRPOTrainer``, in the same run.

    pip install -e ".[bench]"      # TRL is a benchmark-only dependency
    python scripts/bench_grpo.py [--quick] [--prompts 8 --samples 8 --new-tokens 16] [--threads 1 --clock cpu]
                                 [--async-k 1] [--modes server,inprocess] [--vocab 64]
                                 [--trl-checkpointing off]

Both train the same random Qwen3 (hidden 256, 4 layers by default, a word-level tokenizer;
nothing is downloaded) on the same prompts: ``--prompts`` prompts x ``--samples``
completions of exactly ``--new-tokens`` tokens (EOS ignored on both sides), temperature 1,
group-normalised rewards, token-mean loss, no reference model or KL, one optimizer update
per step (AdamW, same learning rate and clipping), float32 on CPU.

* Archon: ``RLTrainer`` as ``scripts/train_rl.py`` runs it, on one training process
  (``archon:d1``), in each mode of ``--modes``: ``server``, one built-in rollout server
  (``local:d1``, its own process, reached over HTTP; a step is rollout + rewards + advantages +
  the update + the weight sync); ``inprocess``, the in-process engine (``inprocess:d1``: the
  built-in generator inside the trainer, on the training weights; no HTTP, no weight sync);
  ``colocated``, the server of ``server`` taking turns with the trainer (``rollout.colocate``:
  it releases its memory while the trainer trains; weights handed over by reference).
* TRL: ``GRPOTrainer`` generating with ``model.generate`` in the training process; a step
  is generation + rewards + advantages + the update.  ``GRPOConfig`` turns gradient
  checkpointing on by default (the forward runs again in the backward); Archon runs without
  activation checkpointing.  ``--trl-checkpointing off`` times TRL without it too.

The two alternate step by step (an Archon step runs in a TRL callback between two TRL
steps).  The modes share the machine's cores (the ``server`` and ``colocated`` modes' servers slow
each other's rollouts on 2 cores): for a mode's figure, time it alone (``--modes colocated``).
``--clock cpu`` counts the CPU time of the whole process tree (the rollout server
included), which on a loaded machine measures the work rather than the wait for a core.

Archon runs both ways: synchronous (``rollout.max_head_offpolicyness = 0``, the step above)
and, with ``--async-k K`` (default 1; 0 skips it), asynchronous, where the server generates
the next steps' rollouts while the trainer trains.  The asynchronous steps are timed in a block
of their own after the alternation (between two TRL steps the server would keep generating for
free), with wall time only (``--clock cpu`` skips them): the work is the same, what asynchrony
removes is the waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
from bench_common import CLOCKS, machine_note, markdown_table, median_ratio


def diversity_reward(prompt: str, completion: str, answer: str | None = None, **_: object) -> float:
    """Distinct words over words of the completion: cheap, and it varies within a group."""
    words = completion.split()
    return len(set(words)) / max(1, len(words))


def _make_assets(root: Path, vocab: int, hidden: int, layers: int, n_rows: int, prompt_len: int) -> Path:
    """A word-level tokenizer, a random Qwen3 using it, and a jsonl of prompts; returns the model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>", model_max_length=4096
    )
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    model.generation_config.bos_token_id = None
    folder = root / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    g = torch.Generator().manual_seed(1)
    with open(root / "train.jsonl", "w") as f:
        for _ in range(n_rows):
            ids = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
            f.write(json.dumps({"prompt": " ".join(words[i] for i in ids), "answer": words[ids[0]]}) + "\n")
    return folder


def _tree_cpu_seconds() -> float:
    """CPU seconds of this process and every descendant (Linux /proc), live children included."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    mine, total = {os.getpid()}, 0.0
    changed = True
    while changed:  # descendants: processes whose parent is already counted
        changed = False
        for pid, (ppid, _) in stats.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                changed = True
    for pid in mine:
        total += stats[pid][1]
    return total


ROLLOUT_BACKENDS = {"server": "local:d1", "colocated": "local:d1", "inprocess": "inprocess:d1"}
"""The rollout backend of each Archon mode."""


def _archon_trainer(root: Path, model: Path, args, k: int = 0, mode: str = "server"):
    from archon.config import load_config
    from archon.rl.trainer import RLTrainer

    overrides = {
        "experiment_name": "bench",
        "trial_name": "grpo",
        "output_dir": str(root / f"archon_{mode}_k{k}"),
        "rollout.max_head_offpolicyness": k,
        # Asynchronous steps train on stale rollouts: AReaL's decoupled objective corrects for them.
        "actor.use_decoupled_loss": k > 0,
        "seed": 1,
        "total_train_steps": 10_000,
        "device": "cpu",
        "cluster.n_gpus_per_node": 2,
        "rollout.backend": ROLLOUT_BACKENDS[mode],
        # Colocated: the server releases its memory while the trainer trains and takes the weights by reference.
        "rollout.colocate": mode == "colocated",
        "actor.backend": "archon:d1",
        "actor.path": str(model),
        "actor.dtype": "float32",
        "actor.adv_estimator": "grpo",
        "actor.ppo_n_minibatches": 1,
        "actor.loss_agg_mode": "token-mean",
        "actor.optimizer.lr": 1e-5,
        "actor.optimizer.max_grad_norm": 1.0,
        "actor.archon.enable_compile": False,
        "actor.archon.ac_mode": "none",
        # Each prompt's n_samples copies go through the model once (same loss and gradients).
        "actor.archon.prefix_sharing": args.prefix_sharing,
        "gconfig.n_samples": args.samples,
        "gconfig.max_new_tokens": args.new_tokens,
        "gconfig.temperature": 1.0,
        "gconfig.ignore_eos": True,
        "train_dataset.path": str(root / "train.jsonl"),
        "train_dataset.batch_size": args.prompts,
        "train_dataset.max_length": 4096,
        "reward.fn": "bench_grpo:diversity_reward",
        "reward.n_workers": 0,
        "saver.freq_steps": 0,
        "saver.export_hf": False,
    }
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    trainer = RLTrainer(cfg)
    trainer.setup()
    return trainer


def _trl_trainer(root: Path, model_folder: Path, args, callback):
    from datasets import Dataset  # pyright: ignore[reportMissingImports] - benchmark-only dependency
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer  # pyright: ignore - benchmark-only dependency (its exports vary)

    rows = [json.loads(line) for line in open(root / "train.jsonl")]

    def reward(prompts, completions, **_) -> list[float | None]:
        return [diversity_reward(p, c) for p, c in zip(prompts, completions)]

    config = GRPOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=args.prompts * args.samples,
        num_generations=args.samples,
        max_completion_length=args.new_tokens,
        gradient_accumulation_steps=1,
        num_iterations=1,
        beta=0.0,
        loss_type="dapo",
        learning_rate=1e-5,
        max_grad_norm=1.0,
        temperature=1.0,
        max_steps=args.reps + 1,
        logging_steps=10_000,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=1,
        # Exactly max_completion_length tokens, as Archon's ignore_eos.
        generation_kwargs={"eos_token_id": None},
        gradient_checkpointing=args.trl_checkpointing == "on",
    )
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    return GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in rows]),
        processing_class=AutoTokenizer.from_pretrained(model_folder),
        callbacks=[callback],
    )


def _time_async(root: Path, model: Path, args) -> tuple[list[float], list[dict[str, float]]]:
    """Wall seconds of ``args.reps`` consecutive asynchronous Archon steps (after one warm-up), and their records."""
    trainer = _archon_trainer(root, model, args, k=args.async_k)
    times, records = [], []
    try:
        trainer.step(1)
        for step in range(2, args.reps + 2):
            t0 = CLOCKS["wall"]()
            records.append(trainer.step(step))
            times.append(CLOCKS["wall"]() - t0)
    finally:
        trainer.close()
    return times, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 timed steps per side")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per completion")
    parser.add_argument("--prompt-len", type=int, default=24, help="words (tokens) per prompt")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    parser.add_argument(
        "--no-prefix-sharing",
        dest="prefix_sharing",
        action="store_false",
        help="train each completion with its own copy of the prompt (actor.archon.prefix_sharing = false)",
    )
    parser.add_argument(
        "--trl-checkpointing",
        choices=["on", "off"],
        default="on",
        help="TRL's gradient checkpointing (on: GRPOConfig's default, which recomputes the forward in the backward; "
        "Archon runs without it, actor.archon.ac_mode = none)",
    )
    parser.add_argument("--reps", type=int, default=None, help="timed steps per side (default 7, quick 3)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads, also for the rollout server (0: torch's default)"
    )
    parser.add_argument(
        "--async-k",
        type=int,
        default=1,
        help="also time asynchronous Archon steps with this rollout.max_head_offpolicyness (0: skip)",
    )
    parser.add_argument(
        "--modes",
        default="server,colocated,inprocess",
        help=f"Archon's rollout modes to time, comma-separated, of {', '.join(ROLLOUT_BACKENDS)}",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or CPU time of the process tree (with --threads 1 on a loaded machine)",
    )
    args = parser.parse_args()
    args.reps = args.reps or (3 if args.quick else 7)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(ROLLOUT_BACKENDS))
    if unknown or not modes:
        parser.error(f"--modes {args.modes!r}: use one or more of {', '.join(ROLLOUT_BACKENDS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the rollout server inherits it
    try:
        import trl  # pyright: ignore[reportMissingImports] - benchmark-only dependency
    except ImportError:
        raise SystemExit("TRL is not installed; it is a benchmark-only dependency: pip install -e '.[bench]'") from None
    from transformers import TrainerCallback

    now = _tree_cpu_seconds if args.clock == "cpu" else CLOCKS["wall"]
    times: dict[str, list[float]] = {"trl": [], **{m: [] for m in modes}}
    archon_parts: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    state = {"step": 1}

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = _make_assets(
            root,
            args.vocab,
            args.hidden,
            args.layers,
            n_rows=args.prompts * (args.reps + 4),
            prompt_len=args.prompt_len,
        )
        archons = {}
        try:
            for mode in modes:
                archons[mode] = _archon_trainer(root, folder, args, mode=mode)
                archons[mode].step(state["step"])  # warm-up
            state["step"] += 1

            class Interleave(TrainerCallback):
                """Times each TRL step; after it, times one Archon step per mode (TRL's first step is a warm-up)."""

                def on_step_begin(self, *_, **__):
                    self.t0 = now()

                def on_step_end(self, _args, trl_state, *__, **___):
                    if trl_state.global_step > 1:
                        times["trl"].append(now() - self.t0)
                        for mode, archon in archons.items():
                            t0 = now()
                            record = archon.step(state["step"])
                            times[mode].append(now() - t0)
                            archon_parts[mode].append(record)
                        state["step"] += 1

            _trl_trainer(root, folder, args, Interleave()).train()
        finally:
            for archon in archons.values():
                archon.close()
        # Asynchrony saves waiting, not work: with --clock cpu there is nothing to compare.
        timed_async = args.async_k and args.clock == "wall"
        async_times, async_parts = _time_async(root, folder, args) if timed_async else ([], [])

    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        [
            f"GRPO step, synchronous, {mode} ({ROLLOUT_BACKENDS[mode]})",
            f"{med['trl']:.3f}",
            f"{med[mode]:.3f}",
            f"{median_ratio(times[mode], times['trl']):.2f}",
        ]
        for mode in modes
    ]
    async_med = statistics.median(async_times) if async_times else 0.0
    if async_times:
        rows.append(
            [
                f"GRPO step, asynchronous (k = {args.async_k}), server",
                f"{med['trl']:.3f}",
                f"{async_med:.3f}",
                f"{async_med / med['trl']:.2f}",
            ]
        )
    print(
        f"GRPO step, Archon RLTrainer (archon:d1) vs TRL {trl.__version__} GRPOTrainer; "
        f"qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, float32; {args.prompts} prompts x "
        f"{args.samples} completions x {args.new_tokens} tokens (prompt {args.prompt_len}), one update; "
        f"TRL gradient checkpointing {args.trl_checkpointing}, Archon none; {machine_note(args.clock)}"
    )
    print(markdown_table(["", "TRL s/step", "Archon s/step", "Archon / TRL time"], rows))
    for mode in modes:
        parts = archon_parts[mode]
        split = {k: statistics.median(r[k] for r in parts) for k in ("rollout_time_s", "train_time_s")}
        sync_key = next((k for k in parts[0] if "sync" in k and k.endswith("_s")), None)
        extra = f", weight sync {statistics.median(r[sync_key] for r in parts):.3f} s" if sync_key else ""
        print(
            f"Archon's own split, {mode} (wall, medians): rollout {split['rollout_time_s']:.3f} s, "
            f"train {split['train_time_s']:.3f} s{extra}"
        )
    if async_times:
        stale = max(r.get("async/staleness_max", 0.0) for r in async_parts)
        print(
            f"Asynchronous (k = {args.async_k}, server, wall, medians): {async_med:.3f} s/step, "
            f"{med['server'] / async_med if 'server' in med else float('nan'):.2f}x the synchronous server steps/s; "
            f"the trainer waited {statistics.median(r['async/wait_s'] for r in async_parts):.3f} s/step for "
            f"rollouts; largest staleness {stale:.0f}"
        )


if __name__ == "__main__":
    main()
