"""GSM8K for the examples (``examples/``): a tiny local GSM8K-format dataset and model, and chat rows for SFT.

    python -m archon.demos.gsm8k make-assets outputs/examples/assets

writes everything the CPU variants of the examples need, without downloading anything:

    OUT_DIR/model/                       tiny randomly initialised Qwen3 + character-level tokenizer with a
                                         Qwen-style chat template (``<|im_start|>`` / ``<|im_end|>``)
    OUT_DIR/data/gsm8k/                  the layout of the hub's ``openai/gsm8k`` folder: ``README.md`` (its
                                         configs) and ``main/{train,test}-00000-of-00001.parquet`` with rows
                                         ``{"question", "answer": "...worked solution...\\n#### 42"}``
    OUT_DIR/data/gsm8k_chat.jsonl        the training rows as chat rows ``{"messages": [user, assistant]}`` (SFT)

The problems are arithmetic word problems written from a handful of hand-written templates with seeded numbers,
with GSM8K's worked answers (``<<3*4=12>>`` calculator notes, ``#### <number>`` last), so the configs read them
exactly as they read the real GSM8K folder (``subset = "main"``, splits ``train`` and ``test``).

    python -m archon.demos.gsm8k chat-rows data/gsm8k data/gsm8k_chat.jsonl

turns a GSM8K folder (the real one: ``hf download --repo-type dataset openai/gsm8k --local-dir data/gsm8k``)
into the chat rows the SFT stage of ``examples/sft_then_rl`` trains on.  Everything is a function of the seed.
"""

from __future__ import annotations

import argparse
import random
import string
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from archon.data.sources import load_rows
from archon.demos.first_letter import TinyQwen3, build_model, write_jsonl

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
"""End of a chat turn, and the model's EOS (as in Qwen3's chat models)."""
UNK_TOKEN = "<unk>"
CHARACTERS = string.printable[:95] + "\n"
"""One token per character: digits, letters, punctuation, space and newline."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen's ChatML layout, without the tool and thinking parts."""
HUB_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""
"""The configs header of the hub folder's README (``datasets`` finds the subsets and splits from it)."""
NAMES = ("Tom", "Mia", "Ravi", "Lena", "Omar", "Sara", "Ken", "Ana")

# A template maps (rng, name) to (question, worked answer, final number).
Template = Callable[[random.Random, str], tuple[str, str, int]]


def _pens(rng: random.Random, name: str) -> tuple[str, str, int]:
    a, b, c = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 20)
    ab = a * b
    question = f"{name} has {a} boxes of {b} pens and buys {c} more pens. How many pens does {name} have?"
    answer = (
        f"The boxes hold {a} * {b} = <<{a}*{b}={ab}>>{ab} pens.\n"
        f"With {c} more, {name} has {ab} + {c} = <<{ab}+{c}={ab + c}>>{ab + c} pens.\n#### {ab + c}"
    )
    return question, answer, ab + c


def _bakery(rng: random.Random, name: str) -> tuple[str, str, int]:
    a, b = rng.randint(10, 40), rng.randint(2, 7)
    made = a * b
    c = rng.randint(1, made - 1)
    question = f"{name} bakes {a} loaves a day for {b} days and sells {c} of them. How many loaves are left?"
    answer = (
        f"{name} bakes {a} * {b} = <<{a}*{b}={made}>>{made} loaves.\n"
        f"After selling {c}, {made} - {c} = <<{made}-{c}={made - c}>>{made - c} are left.\n#### {made - c}"
    )
    return question, answer, made - c


def _reading(rng: random.Random, name: str) -> tuple[str, str, int]:
    a, b = rng.randint(5, 30), rng.randint(2, 12)
    pages = a * b
    question = f"{name} reads {a} pages a day. How many days does {name} need for a book of {pages} pages?"
    answer = f"{name} needs {pages} / {a} = <<{pages}/{a}={b}>>{b} days.\n#### {b}"
    return question, answer, b


def _change(rng: random.Random, name: str) -> tuple[str, str, int]:
    a, b = rng.randint(2, 9), rng.randint(2, 8)
    cost = a * b
    bill = 50 if cost < 50 else 100
    question = f"Pens cost ${a} each. {name} buys {b} pens and pays with a ${bill} bill. How much change is that?"
    answer = (
        f"The pens cost {a} * {b} = <<{a}*{b}={cost}>>{cost} dollars.\n"
        f"The change is {bill} - {cost} = <<{bill}-{cost}={bill - cost}>>{bill - cost} dollars.\n#### {bill - cost}"
    )
    return question, answer, bill - cost


def _chairs(rng: random.Random, name: str) -> tuple[str, str, int]:
    a, b = rng.randint(3, 15), rng.randint(4, 12)
    seats = a * b
    c = rng.randint(1, seats - 1)
    question = f"A hall has {a} rows of {b} chairs. {name} counts {c} people seated. How many chairs are free?"
    answer = (
        f"The hall has {a} * {b} = <<{a}*{b}={seats}>>{seats} chairs.\n"
        f"{seats} - {c} = <<{seats}-{c}={seats - c}>>{seats - c} chairs are free.\n#### {seats - c}"
    )
    return question, answer, seats - c


def _savings(rng: random.Random, name: str) -> tuple[str, str, int]:
    a, b, c = rng.randint(3, 25), rng.randint(2, 10), rng.randint(5, 60)
    saved = a * b
    question = f"{name} saves ${a} a week for {b} weeks and gets ${c} as a gift. How many dollars does {name} have?"
    answer = (
        f"{name} saves {a} * {b} = <<{a}*{b}={saved}>>{saved} dollars.\n"
        f"With the gift, {saved} + {c} = <<{saved}+{c}={saved + c}>>{saved + c} dollars.\n#### {saved + c}"
    )
    return question, answer, saved + c


def _stickers(rng: random.Random, name: str) -> tuple[str, str, int]:
    b, c = rng.randint(2, 6), rng.randint(2, 5)
    given = b * c
    a = given + rng.randint(0, 30)
    question = f"{name} has {a} stickers and gives {b} to each of {c} friends. How many stickers are left?"
    answer = (
        f"{name} gives away {b} * {c} = <<{b}*{c}={given}>>{given} stickers.\n"
        f"{a} - {given} = <<{a}-{given}={a - given}>>{a - given} are left.\n#### {a - given}"
    )
    return question, answer, a - given


TEMPLATES: tuple[Template, ...] = (_pens, _bakery, _reading, _change, _chairs, _savings, _stickers)
"""The hand-written problem shapes: one or two operations each, answers are whole numbers."""


@dataclass(frozen=True)
class TinyGsm8k:
    """How much data ``make_rows`` writes."""

    n_train: int = 64
    """Training rows."""
    n_test: int = 16
    """Held-out rows (no question of them is a training question)."""
    seed: int = 0
    """Seed of the numbers and names."""


TINY_MODEL = TinyQwen3(hidden_size=64, intermediate_size=128, max_position_embeddings=512)
"""The examples' model: 2 layers, hidden 64; prompts are ~130 characters, one token each, plus the template."""


def make_rows(task: TinyGsm8k = TinyGsm8k()) -> dict[str, list[dict[str, str]]]:
    """``train`` and ``test`` rows in GSM8K's shape ``{"question", "answer"}``, distinct questions throughout."""
    rng = random.Random(f"archon-gsm8k-tiny:{task.seed}")
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < task.n_train + task.n_test:
        question, answer, _ = TEMPLATES[len(rows) % len(TEMPLATES)](rng, rng.choice(NAMES))
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": answer})
    return {"train": rows[: task.n_train], "test": rows[task.n_train :]}


def chat_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, list[dict[str, str]]]]:
    """GSM8K rows as chat rows: the question as the user's turn, the worked answer as the assistant's."""
    return [
        {"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
        for r in rows
    ]


def build_tokenizer(max_length: int = TINY_MODEL.max_position_embeddings):
    """A character-level ``PreTrainedTokenizerFast`` over printable ASCII with a ChatML chat template; EOS is
    ``<|im_end|>``, no BOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [PAD_TOKEN, IM_START, IM_END, UNK_TOKEN, *CHARACTERS]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters are joined as they are: decode(encode(s)) == s
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
    )


@dataclass(frozen=True)
class Gsm8kAssets:
    """Where ``make_assets`` wrote each asset."""

    root: Path
    """The output directory."""
    model: Path
    """Model folder, tokenizer files included."""
    gsm8k: Path
    """GSM8K-layout folder (subset 'main', splits 'train' and 'test')."""
    chat: Path
    """The training rows as chat rows (jsonl), for SFT."""


def write_gsm8k_folder(folder: Path, rows: dict[str, list[dict[str, str]]]) -> None:
    """``rows`` (split -> rows) in the hub folder's layout: ``README.md``, ``main/<split>-00000-of-00001.parquet``."""
    import datasets

    (folder / "main").mkdir(parents=True, exist_ok=True)
    for split, split_rows in rows.items():
        datasets.Dataset.from_list(split_rows).to_parquet(str(folder / "main" / f"{split}-00000-of-00001.parquet"))
    (folder / "README.md").write_text(HUB_README)


def make_assets(out_dir: str | Path, task: TinyGsm8k = TinyGsm8k(), spec: TinyQwen3 = TINY_MODEL) -> Gsm8kAssets:
    """Write model, tokenizer and data into ``out_dir`` (overwriting earlier files there)."""
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise ValueError(f"'{root}' exists and is not a directory; pass a directory for the example assets")
    assets = Gsm8kAssets(root, root / "model", root / "data" / "gsm8k", root / "data" / "gsm8k_chat.jsonl")
    tokenizer = build_tokenizer(spec.max_position_embeddings)
    build_model(tokenizer, spec).save_pretrained(assets.model)
    tokenizer.save_pretrained(assets.model)
    rows = make_rows(task)
    write_gsm8k_folder(assets.gsm8k, rows)
    write_jsonl(assets.chat, chat_rows(rows["train"]))
    return assets


def write_chat_rows(gsm8k: str | Path, out: str | Path, split: str = "train", subset: str = "main") -> int:
    """Read a GSM8K folder's ``subset``/``split`` and write its rows as chat rows to ``out``; returns the count."""
    rows = load_rows(gsm8k, split=split, subset=subset)
    write_jsonl(Path(out), chat_rows(rows))
    return len(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m archon.demos.gsm8k", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-assets", help="write the examples' tiny model, tokenizer and GSM8K-format data")
    make.add_argument("out_dir", metavar="OUT_DIR")
    make.add_argument("--seed", type=int, default=0, help="seed of the data and of the model initialisation")
    chat = sub.add_parser("chat-rows", help="write a GSM8K folder's rows as chat rows (jsonl) for SFT")
    chat.add_argument("gsm8k", metavar="GSM8K_DIR")
    chat.add_argument("out", metavar="OUT_JSONL")
    chat.add_argument("--split", default="train")
    chat.add_argument("--subset", default="main")
    args = parser.parse_args(argv)
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()  # one bar per tiny parquet file is noise here
    try:
        if args.command == "chat-rows":
            n = write_chat_rows(args.gsm8k, args.out, args.split, args.subset)
            print(f"wrote {n} chat rows to {args.out}")
            return 0
        assets = make_assets(args.out_dir, TinyGsm8k(seed=args.seed), replace(TINY_MODEL, seed=args.seed))
    except (OSError, ValueError) as exc:  # DataError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"GSM8K example assets in {assets.root}: model {assets.model}, data {assets.gsm8k} and {assets.chat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
