"""The CPU demo: a task a tiny model can only solve by learning from reward, and its local assets.

The task, "first letter": a prompt is six distinct letters from ``a``-``j`` and ``=``, e.g.
``"c a f b e d ="``, and the answer is the first letter, ``"c"`` (scored by the built-in
``exact_match`` reward).  The rule is the same for every prompt, so a 2-layer model picks it
up from reward alone in a few dozen GRPO steps; before that a randomly initialised model
answers with a roughly uniform token, so the reward starts near chance (about 1/14).

    python -m archon.demos.first_letter make-assets outputs/demo/assets

writes everything the demo needs without downloading anything:

    OUT_DIR/tokenizer/        word-level tokenizer (``AutoTokenizer.from_pretrained`` loads it)
    OUT_DIR/model/            tiny Qwen3 (config.json, model.safetensors, generation_config.json) + tokenizer
    OUT_DIR/data/train.jsonl  RL prompts ``{"prompt", "answer"}``
    OUT_DIR/data/test.jsonl   held-out prompts (none of them appears in train.jsonl)
    OUT_DIR/data/sft.jsonl    optional format-only warm start ``{"prompt", "completion"}``: random letters
    OUT_DIR/data/sft_last.jsonl  the LoRA demo's base: the same prompts answered with their LAST letter

Everything is a function of the seeds, so two runs write identical files.  This module
imports neither torch nor transformers at import time: reward workers and ``--help`` stay fast.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archon.rl.rewards import get_reward_fn

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SEPARATOR = "="
REWARD_FN = "exact_match"
"""The reward the demo config uses: the completion must be exactly the answer letter."""


@dataclass(frozen=True)
class DemoTask:
    """The "first letter" task: its alphabet, prompt length and how much data to write."""

    letters: str = "abcdefghij"
    """Alphabet of prompts and answers; every letter is one token."""
    prompt_letters: int = 6
    """Distinct letters per prompt (the answer is the first of them)."""
    n_train: int = 2048
    """RL training prompts."""
    n_test: int = 256
    """Held-out prompts, disjoint from the training prompts."""
    n_sft: int = 1024
    """Rows of the optional format-only SFT file."""
    seed: int = 0
    """Seed of the prompts and of the SFT file's random answers."""

    def __post_init__(self) -> None:
        if len(set(self.letters)) != len(self.letters) or not self.letters.isalpha():
            raise ValueError(f"DemoTask.letters = {self.letters!r} must be distinct letters, e.g. 'abcdefghij'")
        if not 1 <= self.prompt_letters <= len(self.letters):
            raise ValueError(
                f"DemoTask.prompt_letters = {self.prompt_letters} must be between 1 and "
                f"{len(self.letters)} (the number of letters)"
            )


@dataclass(frozen=True)
class TinyQwen3:
    """Shape of the demo model: small enough that a GRPO step takes well under a second on a CPU."""

    hidden_size: int = 128
    """Model width; 128 learns the task in about half the steps of 64 at a small cost per step."""
    intermediate_size: int = 256
    """SwiGLU width."""
    num_hidden_layers: int = 2
    """Decoder blocks."""
    num_attention_heads: int = 4
    """Query heads (head_dim = hidden_size / heads)."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention, as in real Qwen3 models)."""
    max_position_embeddings: int = 64
    """Longest sequence; prompts are 7 tokens."""
    rope_theta: float = 10000.0
    """RoPE base."""
    tie_word_embeddings: bool = True
    """Share embedding and LM head, as small Qwen3 checkpoints do."""
    seed: int = 0
    """Seed of the random initialisation."""


@dataclass(frozen=True)
class DemoAssets:
    """Where ``make_assets`` wrote each asset."""

    root: Path
    """The output directory."""
    tokenizer: Path
    """Tokenizer folder."""
    model: Path
    """Model folder (with the tokenizer files too)."""
    train: Path
    """RL training prompts (jsonl)."""
    test: Path
    """Held-out RL prompts (jsonl)."""
    sft: Path
    """Optional format-only SFT rows (jsonl)."""
    sft_last: Path
    """SFT rows answered with the prompt's last letter (jsonl): the LoRA demo trains its base on them."""


# --------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------


def vocabulary(task: DemoTask = DemoTask()) -> list[str]:
    """Every token, in id order: specials first, so ids do not depend on the alphabet."""
    return [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, *task.letters, SEPARATOR]


def make_prompt(letters: Sequence[str]) -> str:
    """``["c", "a", "f"]`` -> ``"c a f ="``."""
    return " ".join(letters) + f" {SEPARATOR}"


def first_letter(prompt: str) -> str:
    """The task's rule: the answer to ``prompt`` is its first letter."""
    words = prompt.split()
    if len(words) < 2 or words[-1] != SEPARATOR:
        raise ValueError(f"{prompt!r} is not a demo prompt; demo prompts look like 'c a f b e d ='")
    return words[0]


def sample_prompts(task: DemoTask, n: int, rng: random.Random, exclude: Iterable[str] = ()) -> list[str]:
    """``n`` distinct prompts not in ``exclude``."""
    seen = set(exclude)
    available = math.perm(len(task.letters), task.prompt_letters) - len(seen)
    if n > available:
        raise ValueError(
            f"asked for {n} distinct prompts but only {available} exist with "
            f"{task.prompt_letters} of {len(task.letters)} letters; ask for fewer"
        )
    prompts: list[str] = []
    while len(prompts) < n:
        prompt = make_prompt(rng.sample(task.letters, task.prompt_letters))
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


def last_letter(prompt: str) -> str:
    """The LoRA demo's base rule: the letter just before ``=``."""
    first_letter(prompt)  # the same check of the prompt's shape
    return prompt.split()[-2]


def make_rows(task: DemoTask = DemoTask()) -> dict[str, list[dict[str, str]]]:
    """The data files' rows: ``train`` and ``test`` (prompt/answer), ``sft`` and ``sft_last`` (prompt/completion)."""
    # A string seed is hashed with SHA-512 by `random`: the same rows on every platform.
    rng = random.Random(f"archon-demo:{task.seed}")
    prompts = sample_prompts(task, task.n_train + task.n_test, rng)
    train, test = prompts[: task.n_train], prompts[task.n_train :]
    sft_rng = random.Random(f"archon-demo-sft:{task.seed}")
    # The SFT answers are uniformly random letters: they teach the answer's shape (one letter,
    # then EOS) and nothing about which letter is right.
    sft = [
        {"prompt": p, "completion": sft_rng.choice(task.letters)}
        for p in (sft_rng.choice(train) for _ in range(task.n_sft))
    ]
    return {
        "train": [{"prompt": p, "answer": first_letter(p)} for p in train],
        "test": [{"prompt": p, "answer": first_letter(p)} for p in test],
        "sft": sft,
        # A model SFT-trained on these copies a letter of the prompt (the wrong one): a base with the skill the
        # task needs, that LoRA adapters re-target by RL (configs/cpu_demo_lora.toml).
        "sft_last": [{"prompt": p, "completion": last_letter(p)} for p in train],
    }


def uniform_policy_reward(
    rows: Sequence[dict[str, Any]], candidates: Sequence[str], reward_fn: Callable[..., Any] | str = REWARD_FN
) -> float:
    """Expected reward of a policy that answers every prompt with a uniformly random candidate.

    With ``candidates`` = the decoded vocabulary this is the chance level of a randomly
    initialised model (whose next-token distribution is close to uniform).
    """
    if not rows or not candidates:
        raise ValueError("uniform_policy_reward needs at least one row and one candidate answer")
    fn = get_reward_fn(reward_fn)
    total = 0.0
    for row in rows:
        total += sum(float(fn(row["prompt"], c, row["answer"])) for c in candidates) / len(candidates)
    return total / len(rows)


# --------------------------------------------------------------------------------------
# Tokenizer and model
# --------------------------------------------------------------------------------------


def build_tokenizer(task: DemoTask = DemoTask(), max_length: int = TinyQwen3.max_position_embeddings):
    """A word-level ``PreTrainedTokenizerFast`` over the task's symbols; no chat template, no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(vocabulary(task))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder joins words with spaces, so decode(encode(prompt)) == prompt.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=UNK_TOKEN, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, model_max_length=max_length
    )


def build_model(tokenizer: Any, spec: TinyQwen3 = TinyQwen3()):
    """A randomly initialised ``Qwen3ForCausalLM`` (float32) sized for ``tokenizer``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if spec.hidden_size % spec.num_attention_heads:
        raise ValueError(
            f"TinyQwen3.hidden_size = {spec.hidden_size} must be a multiple of "
            f"num_attention_heads = {spec.num_attention_heads}"
        )
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    # transformers initialises from the global RNG; fork it so callers' RNG state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)  # pyright: ignore[reportArgumentType] - transformers' .to typing
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model.eval()


# --------------------------------------------------------------------------------------
# Writing the assets
# --------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line (the format archon.data reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def make_assets(out_dir: str | Path, task: DemoTask = DemoTask(), spec: TinyQwen3 = TinyQwen3()) -> DemoAssets:
    """Write tokenizer, model and data into ``out_dir`` (overwriting earlier demo files there)."""
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"'{root}' exists and is not a directory; pass a directory for the demo assets")
    assets = DemoAssets(
        root=root,
        tokenizer=root / "tokenizer",
        model=root / "model",
        train=root / "data" / "train.jsonl",
        test=root / "data" / "test.jsonl",
        sft=root / "data" / "sft.jsonl",
        sft_last=root / "data" / "sft_last.jsonl",
    )
    tokenizer = build_tokenizer(task, spec.max_position_embeddings)
    tokenizer.save_pretrained(assets.tokenizer)
    build_model(tokenizer, spec).save_pretrained(assets.model)
    tokenizer.save_pretrained(assets.model)
    rows = make_rows(task)
    write_jsonl(assets.train, rows["train"])
    write_jsonl(assets.test, rows["test"])
    write_jsonl(assets.sft, rows["sft"])
    write_jsonl(assets.sft_last, rows["sft_last"])
    return assets


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m archon.demos.first_letter",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-assets", help="write the demo's tokenizer, tiny model and data into OUT_DIR")
    make.add_argument("out_dir", metavar="OUT_DIR")
    make.add_argument("--seed", type=int, default=0, help="seed of the data and of the model initialisation")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress bar per tiny shard is noise here
    try:
        assets = make_assets(args.out_dir, DemoTask(seed=args.seed), TinyQwen3(seed=args.seed))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from archon.data.jsonl import load_jsonl

    rows = load_jsonl(assets.test)
    vocab = vocabulary(DemoTask(seed=args.seed))
    chance = uniform_policy_reward(rows, vocab)
    print(
        f"demo assets in {assets.root}: model {assets.model}, data {assets.train.parent}\n"
        f"task: answer with the first letter of the prompt (e.g. {rows[0]['prompt']!r} -> {rows[0]['answer']!r}); "
        f"chance reward of a uniform answer over the {len(vocab)}-token vocabulary: {chance:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
