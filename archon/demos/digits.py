"""The multi-token CPU demo: a task whose answers are several tokens long and end with EOS.

The task, "repeat the number": a prompt is a number of ``digits`` digits and ``=``, written one
character per token (``"471="``), and the answer is the same digits, then EOS (``"471"``).  A
randomly initialised model answers with random characters and rarely stops in the right place;
GRPO teaches it from reward alone, every digit and the stop.  Each rollout is several decoding
steps, so generation costs about as much as training and asynchronous RL
(``rollout.max_head_offpolicyness``) has something to overlap; the one-token demo
(``archon.demos.first_letter``) has not.

Why not arithmetic: multi-digit sums (two digits, no carries) and increments (``"472+1="``) were
tried first; from a random 2-layer model they stayed below 0.55 of the reward after 100-150
steps, where this task reaches 0.9 in about 70 (``README.md``, asynchronous RL).

    python -m archon.demos.digits make-assets outputs/demo_digits/assets

writes, without downloading anything:

    OUT_DIR/model/            tiny Qwen3 + character-level tokenizer (digits, '+', '=', specials)
    OUT_DIR/data/train.jsonl  RL prompts ``{"prompt", "answer"}``
    OUT_DIR/data/test.jsonl   held-out prompts (none of them appears in train.jsonl)

The reward (``digits_reward``) is the fraction of answer digits right in place, halved unless the
completion stops with EOS right after the answer, judged on the token ids; with
``gconfig.max_new_tokens = digits + 1`` a completion either stops or runs one token too long.
Everything is a function of the seeds.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archon.demos.first_letter import EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, TinyQwen3, build_model, write_jsonl

SEPARATOR = "="
CHARACTERS = "0123456789+="
"""Every non-special token: one per character."""
REWARD_FN = "archon.demos.digits:digits_reward"
"""The reward the demo config uses."""


@dataclass(frozen=True)
class DigitsTask:
    """The "repeat the number" task: its length and how much data to write."""

    digits: int = 3
    """Digits per number (and per answer); answers are this many tokens plus EOS."""
    n_train: int = 4096
    """RL training prompts (numbers repeat only if there are fewer distinct ones)."""
    n_test: int = 256
    """Held-out prompts, disjoint from the training prompts."""
    seed: int = 0
    """Seed of the numbers."""

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 8:
            raise ValueError(f"DigitsTask.digits = {self.digits} must be between 1 and 8")
        if self.n_test >= 10**self.digits:
            raise ValueError(
                f"DigitsTask.n_test = {self.n_test} must be below the {10**self.digits} numbers of "
                f"{self.digits} digits, so that training prompts remain"
            )


def vocabulary() -> list[str]:
    """Every token, in id order: specials first (pad, EOS, unk), then the characters."""
    return [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, *CHARACTERS]


def make_prompt(number: str) -> str:
    """``"471"`` -> ``"471="``."""
    return f"{number}{SEPARATOR}"


def answer_of(prompt: str) -> str:
    """The task's rule: the answer to ``"471="`` is ``"471"``."""
    if not prompt.endswith(SEPARATOR) or not prompt[:-1].isdigit():
        raise ValueError(f"{prompt!r} is not a digits-demo prompt; they look like '471='")
    return prompt[:-1]


def digits_reward(prompt: str, completion: str, answer: str, *, completion_ids: Sequence[int], **_: Any) -> float:
    """Fraction of ``answer``'s digits that the completion has in the same place, halved unless it
    stopped with EOS right after them.

    Judged on the token ids: the text has no special tokens, so it cannot tell EOS from a
    padding or unknown token, and a policy judged on text learns to emit those instead (it did:
    ``"13<unk>5"`` read as ``"135"``).
    """
    if not answer:
        raise ValueError("digits_reward needs a non-empty answer")
    vocab = vocabulary()
    tokens = [vocab[i] if 0 <= i < len(vocab) else UNK_TOKEN for i in completion_ids]
    right = sum(a == b for a, b in zip(tokens, answer)) / len(answer)
    stopped = len(tokens) == len(answer) + 1 and tokens[-1] == EOS_TOKEN
    return right if stopped else 0.5 * right


def make_rows(task: DigitsTask = DigitsTask()) -> dict[str, list[dict[str, str]]]:
    """``train`` and ``test`` rows ``{"prompt", "answer"}``; no test number is a training number."""
    rng = random.Random(f"archon-demo-digits:{task.seed}")
    numbers = [str(n).zfill(task.digits) for n in range(10**task.digits)]
    rng.shuffle(numbers)
    test, rest = numbers[: task.n_test], numbers[task.n_test :]
    train = [rest[i % len(rest)] for i in range(task.n_train)]
    return {
        "train": [{"prompt": make_prompt(n), "answer": n} for n in train],
        "test": [{"prompt": make_prompt(n), "answer": n} for n in test],
    }


def build_tokenizer(max_length: int = TinyQwen3.max_position_embeddings):
    """The digits demo's character-level tokenizer (``char_tokenizer`` of its vocabulary)."""
    return char_tokenizer(vocabulary(), max_length)


def char_tokenizer(vocab: Sequence[str], max_length: int = TinyQwen3.max_position_embeddings):
    """A character-level ``PreTrainedTokenizerFast`` over ``vocab`` (specials first, then one token per
    character); no BOS, no template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # decode(encode(s)) == s: characters are joined without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=UNK_TOKEN, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, model_max_length=max_length
    )


@dataclass(frozen=True)
class DigitsAssets:
    """Where ``make_assets`` wrote each asset."""

    root: Path
    """The output directory."""
    model: Path
    """Model folder, tokenizer files included."""
    train: Path
    """RL training prompts (jsonl)."""
    test: Path
    """Held-out RL prompts (jsonl)."""


_DEFAULT_SPEC = TinyQwen3()
"""``make_assets``'s default model (frozen, so one shared instance is safe)."""


def make_assets(out_dir: str | Path, task: DigitsTask = DigitsTask(), spec: TinyQwen3 = _DEFAULT_SPEC) -> DigitsAssets:
    """Write model, tokenizer and data into ``out_dir`` (overwriting earlier files there)."""
    return write_assets(out_dir, build_tokenizer(spec.max_position_embeddings), spec, make_rows(task))


def write_assets(
    out_dir: str | Path, tokenizer: Any, spec: TinyQwen3, rows: dict[str, list[dict[str, str]]]
) -> DigitsAssets:
    """A random model of ``spec`` for ``tokenizer`` with it in ``OUT_DIR/model``, and the ``train`` / ``test``
    ``rows`` as jsonl in ``OUT_DIR/data``."""
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise ValueError(f"'{root}' exists and is not a directory; pass a directory for the demo assets")
    assets = DigitsAssets(root, root / "model", root / "data" / "train.jsonl", root / "data" / "test.jsonl")
    build_model(tokenizer, spec).save_pretrained(assets.model)
    tokenizer.save_pretrained(assets.model)
    write_jsonl(assets.train, rows["train"])
    write_jsonl(assets.test, rows["test"])
    return assets


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m archon.demos.digits", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-assets", help="write the demo's tokenizer, tiny model and data into OUT_DIR")
    make.add_argument("out_dir", metavar="OUT_DIR")
    make.add_argument("--seed", type=int, default=0, help="seed of the data and of the model initialisation")
    make.add_argument("--digits", type=int, default=DigitsTask.digits, help="digits per number")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        # A quarter of the numbers at most are held out, so that short numbers leave training data.
        task = DigitsTask(digits=args.digits, seed=args.seed, n_test=min(DigitsTask.n_test, 10**args.digits // 4))
        assets = make_assets(args.out_dir, task, TinyQwen3(seed=args.seed))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    example = make_rows(task)["test"][0]
    print(
        f"digits demo assets in {assets.root}: model {assets.model}, data {assets.train.parent}\n"
        f"task: repeat the number, then stop (e.g. {example['prompt']!r} -> {example['answer']!r} + EOS)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
